"""Hierarchical allreduce over a 2-D ``DeviceMesh`` ("inter", "intra"): plain inside a node,
where links are fast, quantized between nodes, where they are slow.

Default: reduce-scatter inside the node, quantized allreduce of each shard between nodes (every
GPU talks), all-gather inside the node. ``intra_broadcast`` (``CGX_INTRA_BROADCAST=1``) is
CGX's variant: reduce to the node's first GPU, which alone talks across nodes, then broadcast.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import config, cpu_threads
from ..checks import (
    check_bits,
    check_bool,
    check_bucket_size,
    check_collective_tensor,
    check_reduce_op,
    check_seed,
)
from . import policy
from .allreduce import allreduce
from .call_settings import CallSettings
from .fusion import quantized_bytes_sent, reduce_fused_, ring_bytes_sent
from .rotations import DEFAULT_BLOCK

__all__ = [
    "MESH_DIMS",
    "hierarchical_allreduce",
    "hierarchical_allreduce_fused_",
    "node_mesh",
]

MESH_DIMS = ("inter", "intra")


def node_mesh(device_type: str | None = None) -> DeviceMesh:
    """The ("inter", "intra") mesh of the default group, one row per node, read from the
    launcher's ``LOCAL_WORLD_SIZE`` (torchrun, or mpirun through :mod:`cgx2.launch`)."""
    world = dist.get_world_size()
    local = config.launch().local_world_size or world
    if world % local:
        raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide the world size {world}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world // local, local), mesh_dim_names=MESH_DIMS)


def hierarchical_allreduce(
    t: torch.Tensor,
    bits: int = 4,
    mesh: DeviceMesh | None = None,
    op: dist.ReduceOp | str = dist.ReduceOp.SUM,
    bucket_size: int = 512,
    intra_broadcast: bool | None = None,
    seed: int | None = None,
    *,
    rotation: str | None = None,
    rotation_block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Allreduce (SUM or AVG) of ``t`` over ``mesh`` (default :func:`node_mesh`), quantized to
    ``bits`` between nodes only. Returns a new tensor, bit-identical on every rank.
    ``intra_broadcast`` None reads ``CGX_INTRA_BROADCAST``. ``rotation``, ``rotation_block``:
    the quantized allreduce's between nodes (:func:`.allreduce.allreduce`)."""
    check_collective_tensor(t, "t")
    reduce_op = check_reduce_op(op, "op")
    check_bits(bits)
    check_bucket_size(bucket_size)
    check_seed(seed)
    settings = CallSettings.of(bits, bucket_size, reduce_op, seed, False, rotation, rotation_block)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if intra_broadcast is not None:
        check_bool(intra_broadcast, "intra_broadcast")
    mesh = node_mesh(t.device.type) if mesh is None else mesh
    return _over_mesh(t, mesh, settings, intra_broadcast)


def _over_mesh(
    t: torch.Tensor, mesh: DeviceMesh, settings: CallSettings, intra_broadcast: bool | None
) -> torch.Tensor:
    """:func:`hierarchical_allreduce` of checked arguments, but for the mesh's dims (a hook's
    mesh is first used here)."""
    if mesh.mesh_dim_names != MESH_DIMS:
        raise ValueError(f"mesh must have dims {MESH_DIMS}, got {mesh.mesh_dim_names}")
    if intra_broadcast is None:
        intra_broadcast = config.cgx().intra_broadcast
    between_nodes = dataclasses.replace(settings, reduce_op="sum")  # averaged once gathered
    inter, intra = mesh.get_group("inter"), mesh.get_group("intra")
    local, local_rank = dist.get_world_size(intra), dist.get_rank(intra)
    flat = t.reshape(-1)
    if intra_broadcast:
        node_sum = flat.clone()
        leader = dist.get_global_rank(intra, 0)
        dist.reduce(node_sum, dst=leader, group=intra)
        if local_rank == 0:
            node_sum = allreduce(node_sum, inter, between_nodes)
        dist.broadcast(node_sum, src=leader, group=intra)
        out = node_sum
    else:
        padded = -(-flat.numel() // local) * local
        staged = torch.empty(padded, dtype=t.dtype, device=t.device)
        staged[flat.numel() :].zero_()
        cpu_threads.copy_(staged[: flat.numel()], flat)
        shard = torch.empty(padded // local, dtype=t.dtype, device=t.device)
        inside = policy.transport(t.device, intra)  # shared memory, where the node's is
        inside.reduce_scatter_plain(shard, staged, intra)
        shard = allreduce(shard, inter, between_nodes)
        inside.wait(inside.all_gather(staged, shard, intra, async_op=False))
        out = staged[: flat.numel()]
    if settings.reduce_op == "avg":
        out = cpu_threads.div_(out, mesh.size())  # out is this call's own: in place
    return out.view(t.shape)


def hierarchical_allreduce_fused_(
    layers: list[torch.Tensor], mesh: DeviceMesh, settings: CallSettings, intra_broadcast: bool
) -> int:
    """:func:`hierarchical_allreduce` of ``layers`` in place, fused into one buffer (each
    padded to whole buckets); returns the bytes this rank sent, as the default variant sends
    them: the plain reduce-scatter and all-gather inside the node, and the quantized
    allreduce of a 1/L shard between nodes."""
    bucket_size = settings.bucket_size
    fused = reduce_fused_(
        layers, bucket_size, lambda x: _over_mesh(x, mesh, settings, intra_broadcast)
    )
    nodes, local = mesh.size(0), mesh.size(1)
    shard = -(-fused.numel() // local)
    between = quantized_bytes_sent(
        shard, nodes, settings.bits, bucket_size, gather_all=policy.gathers_all()
    )
    return ring_bytes_sent(fused.numel() * fused.element_size(), local) + between
