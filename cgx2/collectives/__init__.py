"""The quantized collectives: algorithms over a codec (:mod:`cgx2.codecs`) and a transport
(:mod:`cgx2.comm`), each call routed by :mod:`.policy`.

:func:`allreduce` / :func:`allreduce_` and :func:`reduce_scatter` are what the ops and entry
points call, a call's settings as one :class:`CallSettings`; :mod:`.fusion` and
:mod:`.hierarchical` build on them; :mod:`.reference` models them bit for bit.
"""

from . import crossovers, measure, policy
from .allreduce import allreduce, allreduce_, exchange
from .call_settings import CallSettings
from .fusion import (
    allreduce_fused_,
    fuse_padded,
    padded_numel,
    quantized_bytes_sent,
    ring_bytes_sent,
)
from .hierarchical import hierarchical_allreduce, hierarchical_allreduce_fused_, node_mesh
from .reduce_scatter import Segment, reduce_scatter
from .reference import reference_allreduce, reference_reduce_scatter

# The policy measures a link at first use with collectives built on it: handed down here, where
# both are known, so that no module imports one above it, inside a function or not.
crossovers.measure_with(measure)

__all__ = [
    "CallSettings",
    "Segment",
    "allreduce",
    "allreduce_",
    "allreduce_fused_",
    "exchange",
    "fuse_padded",
    "hierarchical_allreduce",
    "hierarchical_allreduce_fused_",
    "node_mesh",
    "padded_numel",
    "policy",
    "quantized_bytes_sent",
    "reduce_scatter",
    "reference_allreduce",
    "reference_reduce_scatter",
    "ring_bytes_sent",
]
