"""``QuantizedPartial``: a DTensor placement pending a reduction that cgx2 quantizes.

``dt.redistribute(mesh, [Replicate()])`` from it runs cgx2's quantized allreduce over that mesh
dimension, ``[Shard(d)]`` its quantized reduce-scatter; ``Replicate → QuantizedPartial``
partitions as ``Partial`` does.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import Placement

from ..checks import check_bits, check_bucket_size
from ..collectives.rotations import DEFAULT_BLOCK, check_rotation

__all__ = ["QuantizedPartial"]


class QuantizedPartial(Partial):
    """Pending a sum (``reduce_op="sum"``) or average (``"avg"``) over a mesh dimension, to be
    sent as ``bits``-bit max-min payloads in buckets of ``bucket_size`` values.

    Redistributed to ``Replicate()``, every rank of the mesh dimension gets bit-identical
    values (:func:`cgx2.quantized_allreduce`: each value quantized twice, unbiased); to
    ``Shard(d)``, each rank gets its part (:func:`cgx2.quantized_reduce_scatter`: quantized
    once). Uneven shards are padded as DTensor pads them. ``bits=32`` reduces exactly.
    ``rotation="hadamard"`` codes the values' randomized Hadamard rotation in blocks of
    ``rotation_block`` (a power of two dividing ``bucket_size``), signs fresh every call and
    alike on every rank (:func:`cgx2.quantized_allreduce`).

    Two placements are equal, hash alike and print alike only when all their fields are
    equal, so that a compiled graph never takes a 4-bit placement for an 8-bit one, nor a
    rotated one for an unrotated one.

    Example::

        >>> from torch.distributed.tensor import DTensor, Replicate
        >>> from cgx2.dtensor import QuantizedPartial
        >>> dt = DTensor.from_local(grad, mesh, [QuantizedPartial(bits=4)])
        >>> total = dt.redistribute(mesh, [Replicate()]).to_local()
    """

    bits: int
    bucket_size: int
    rotation: str | None
    rotation_block: int

    def __init__(
        self,
        bits: int = 4,
        bucket_size: int = 512,
        reduce_op: str = "sum",
        *,
        rotation: str | None = None,
        rotation_block: int = DEFAULT_BLOCK,
    ) -> None:
        check_bits(bits)
        check_bucket_size(bucket_size)
        rotation = check_rotation(rotation, rotation_block, bucket_size)
        if reduce_op not in ("sum", "avg"):
            raise ValueError(
                f"reduce_op must be 'sum' or 'avg' (QuantizedPartial's reduction), "
                f"got {reduce_op!r}"
            )
        super().__init__(reduce_op)
        # Frozen like every placement: fields are set once, here.
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "bucket_size", bucket_size)
        object.__setattr__(self, "rotation", rotation)
        object.__setattr__(self, "rotation_block", rotation_block)

    def _rotation_args(self) -> tuple[str | int, ...]:
        """The ops' trailing rotation arguments (none without rotation: the old schema)."""
        return () if self.rotation is None else (self.rotation, self.rotation_block)

    def _reduce_value(self, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
        name = funcol._resolve_group_name((mesh, mesh_dim))
        return torch.ops.cgx.quantized_allreduce(
            tensor.contiguous(),
            self.bits,
            self.bucket_size,
            name,
            self.reduce_op,
            -1,
            False,
            *self._rotation_args(),
        ).view(tensor.shape)

    def _reduce_shard_value(
        self, tensor: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, shard_spec: Placement
    ) -> torch.Tensor:
        if not isinstance(shard_spec, Shard):
            raise NotImplementedError(
                f"QuantizedPartial reduces to Shard or Replicate, not {shard_spec}"
            )
        if mesh.get_coordinate() is None:  # not a rank of this mesh: nothing to reduce
            return tensor
        world = mesh.size(mesh_dim)
        rank = mesh.get_local_rank(mesh_dim)
        dim = shard_spec.dim % tensor.dim()
        size = tensor.size(dim)
        part = -(-size // world)  # torch.chunk's: the last parts may be shorter, or empty
        rows = tensor.movedim(dim, 0)
        if part * world != size:
            rows = torch.cat([rows, rows.new_zeros(part * world - size, *rows.shape[1:])])
        name = funcol._resolve_group_name((mesh, mesh_dim))
        mine = torch.ops.cgx.quantized_reduce_scatter(
            rows.contiguous(),
            self.bits,
            self.bucket_size,
            world,
            name,
            self.reduce_op,
            -1,
            *self._rotation_args(),
        )
        mine = mine[: max(0, min(part, size - rank * part))]
        return mine.movedim(0, dim).contiguous()

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is QuantizedPartial
            and self.reduce_op == other.reduce_op
            and self.bits == other.bits
            and self.bucket_size == other.bucket_size
            and self.rotation == other.rotation
            and self.rotation_block == other.rotation_block
        )

    def __hash__(self) -> int:
        return hash(
            (
                "QuantizedPartial",
                self.reduce_op,
                self.bits,
                self.bucket_size,
                self.rotation,
                self.rotation_block,
            )
        )

    def __repr__(self) -> str:
        rotated = ""
        if self.rotation is not None:
            rotated = f", rotation={self.rotation!r}, rotation_block={self.rotation_block}"
        return (
            f"QuantizedPartial(bits={self.bits}, bucket_size={self.bucket_size}, "
            f"reduce_op={self.reduce_op!r}{rotated})"
        )

    def __str__(self) -> str:
        rotated = "" if self.rotation is None else f", {self.rotation} {self.rotation_block}"
        return f"QP({self.reduce_op}, {self.bits}b, {self.bucket_size}{rotated})"

    def __fx_repr__(self) -> tuple[str, dict[str, object]]:
        # FX-evaluable, with the globals it needs: how a compiled graph spells the placement.
        return repr(self), {"QuantizedPartial": QuantizedPartial}


def _register_as_opaque() -> None:
    """Let compiled code pass it to ops as torch's own placements are, on torch versions that
    register ``Partial`` as an opaque value type (2.13); where torch does not (2.11), its
    placements reach compiled code as constants, and so does this one."""
    try:
        from torch._library import opaque_object
    except ImportError:
        return
    is_opaque = getattr(opaque_object, "is_opaque_type", None)
    if is_opaque is None or not is_opaque(Partial):
        return
    real = opaque_object.MemberType.USE_REAL
    members = {
        name: real
        for name in (
            "is_shard",
            "is_partial",
            "is_replicate",
            "__eq__",
            "reduce_op",
            "bits",
            "bucket_size",
            "rotation",
            "rotation_block",
        )
    }
    opaque_object.register_opaque_type(QuantizedPartial, typ="value", members=members)


_register_as_opaque()
