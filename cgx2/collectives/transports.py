"""What moves a group's bytes (the transport registry: the process group, shared memory, NCCL)
and on which thread an entry point that returns a future runs its collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import config
from ..comm import Transport, group_info, nccl, process_group, shm
from . import decided

__all__ = ["coalesces_exact", "runs_on_worker", "transport"]


def transport(device: torch.device, group: dist.ProcessGroup) -> Transport:
    """What moves the bytes of ``device``'s tensors over ``group`` (docs/transports.md):
    ``CGX2_TRANSPORT`` where it names one (``nccl``: cgx2's grouped send/receive on the NCCL
    group's communicator, opt-in until measured on several GPUs); else (``auto``) shared memory
    (:mod:`cgx2.comm.shm`, which itself falls back to the process group for a group that spans
    hosts) where ``CGX_INNER_COMMUNICATOR_TYPE`` is SHM and the process group would cross host
    memory anyway: CPU tensors, and CUDA tensors on a group whose CUDA collectives are not
    NCCL's. NCCL keeps CUDA tensors: its transfers are queued on the GPU, the shared-memory
    ones wait on the host. Without the compiled extension, the process group. Decided once
    per group, device and settings (:mod:`.decided`): DDP's plain path asks per bucket."""
    state = decided.state(group)
    found = state.transports.get(device)
    if found is None:
        found = state.transports[device] = _choose(device, group)
    return found


def _choose(device: torch.device, group: dist.ProcessGroup) -> Transport:
    """:func:`transport`'s choice, made anew."""
    chosen = config.tuning().transport
    if chosen == "nccl":  # CUDA tensors on NCCL groups; anything else falls to the group's
        return nccl if nccl.available() else process_group
    if chosen == "process_group" or not shm.available():
        return process_group
    if chosen == "shm":
        return shm
    if config.cgx().inner_communicator != "SHM":
        return process_group
    cuda_on_nccl = device.type == "cuda" and group_info(group).cuda_on_nccl
    return process_group if cuda_on_nccl else shm


def runs_on_worker(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether an entry point that returns a future (DDP's hooks) runs the collectives of
    ``t`` over ``group`` on the group's worker thread (:func:`cgx2.comm.worker.submit`): where
    they would hold the calling thread until the bytes have crossed (gloo's, for CPU tensors
    and for CUDA tensors staged through host memory) and ``CGX2_COMM_WORKER`` allows it.
    NCCL's are enqueued on a stream and return at once."""
    return config.tuning().comm_worker and not (t.is_cuda and group_info(group).cuda_on_nccl)


def coalesces_exact(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether DDP's hooks hold the exact layers (biases, norms) of every compressed bucket of
    ``t``'s kind for the backward pass's last bucket, to average them all in one plain
    allreduce: CUDA tensors on NCCL, whose hooks run inline (across hosts each small
    allreduce would pay the link's latency between the quantized ones). gloo keeps an
    allreduce a bucket, on the worker and inline alike (the same bits either way)."""
    return t.is_cuda and group_info(group).cuda_on_nccl
