"""The Philox keys of an allreduce's pipeline pieces, derived on the GPU from a call seed held in
device memory: :mod:`cgx2.seeding`'s SplitMix64 path, for CUDA graphs, which freeze arguments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["piece_keys"]

_BLOCK = 64


@triton.jit
def _splitmix64(x):
    """:func:`cgx2.seeding._splitmix64` on uint64 (literals above 2**63 are uint64 in Triton,
    and uint64 arithmetic wraps as the Python's masks do)."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit(do_not_specialize=["rank", "pieces"])  # rank 1 would be a constexpr int
def _piece_keys_kernel(
    seed_ptr,
    out_ptr,
    rank,
    pieces,
    SCATTER: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seed = tl.load(seed_ptr).to(tl.uint64, bitcast=True)
    base = _splitmix64(seed)
    scatter = _splitmix64(_splitmix64(base ^ SCATTER) ^ rank.to(tl.uint64))
    gather = _splitmix64(base ^ GATHER)
    lanes = tl.arange(0, BLOCK)
    for start in range(0, pieces, BLOCK):
        i = start + lanes
        mask = i < pieces
        s = _splitmix64(scatter ^ i.to(tl.uint64))
        g = _splitmix64(gather ^ i.to(tl.uint64))
        tl.store(out_ptr + 2 * i, s.to(tl.int64, bitcast=True), mask=mask)
        tl.store(out_ptr + 2 * i + 1, g.to(tl.int64, bitcast=True), mask=mask)


def piece_keys(
    seed: torch.Tensor, rank: int, pieces: int, scatter_stage: int, gather_stage: int
) -> torch.Tensor:
    """int64 ``[2 * pieces]``: at ``2i``, ``derive_key(s, scatter_stage, rank, i)``, at
    ``2i + 1``, ``derive_key(s, gather_stage, i)``, where ``s`` is the int64 in ``seed`` (one
    value on the device, read when the kernel runs), as unsigned 64-bit keys' bits."""
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError("seed must hold one int64")
    out = torch.empty(2 * pieces, dtype=torch.int64, device=seed.device)
    _piece_keys_kernel[(1,)](
        seed, out, rank, pieces, SCATTER=scatter_stage, GATHER=gather_stage, BLOCK=_BLOCK
    )
    return out
