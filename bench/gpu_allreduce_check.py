"""GPU check of the quantized allreduce under torchrun: every rank's result must equal, bit for
bit, the single-process model ``cgx2.collectives.reference_allreduce`` computed on the CPU.

Run: ``torchrun --nproc-per-node N bench/gpu_allreduce_check.py``; exits 1 on any mismatch.
"""

from __future__ import annotations

import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every case must take the quantized path, however small: no fallback to the plain allreduce.
os.environ["CGX2_CROSSOVER_BYTES"] = "0"

import torch
import torch.distributed as dist
from common import ranks_failed, say

import cgx2
from cgx2 import collectives, config
from cgx2.collectives import graphs, policy
from cgx2.collectives.allreduce import STAGE_SCATTER

_settings = contextlib.ExitStack()


def _tune(**changes: object) -> None:
    """cgx2's settings for the cases that follow (each call replaces the last one's)."""
    _settings.close()
    _settings.enter_context(config.tuned(**changes))


INT = {2: torch.int16, 4: torch.int32}
CASES = [
    # bits, dtype, numel, op, skip_incomplete, pipeline piece bytes (0: 64 MiB; None: the
    # regime's cgx2.collectives.policy.PIECE_NUMEL, what users get)
    *[(b, torch.float32, 1_000_007, "avg", False, 0) for b in range(1, 9)],
    *[(b, torch.bfloat16, 1_000_007, "sum", False, 0) for b in (2, 3, 4, 6, 8)],
    (4, torch.float16, 100_003, "avg", True, 0),
    (4, torch.float32, 1, "sum", False, 0),
    (5, torch.float32, 1009, "sum", True, 0),
    (4, torch.float32, 4_000_037, "avg", False, 1 << 20),  # many pipeline pieces
    (3, torch.bfloat16, 4_000_037, "sum", True, 1 << 20),
    (4, torch.float32, 33_554_467, "avg", False, None),  # 3 pieces over shm and sockets
]


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(n, generator=g) * (rank + 1) + rank).to(dtype)


def _error_matches(
    x: torch.Tensor,
    error: torch.Tensor,
    bits: int,
    skip: bool,
    world: int,
    rank: int,
    device: str = "cuda",
) -> bool:
    """``error`` of rank ``rank`` against the reference codec: per pipeline piece, its input
    minus the decoded payloads it sent (zero on the chunk it owns)."""
    from cgx2.codecs import ChunkedLayout, maxmin
    from cgx2.seeding import derive_key

    flat, expected = x.reshape(-1), torch.empty_like(error.reshape(-1))
    where = policy.regime(torch.device(device))
    step = policy.piece_numel(
        x.element_size(), world, 512, where, policy.uses_pair_gather(world, where)
    )
    for index, s in enumerate(range(0, flat.numel(), step)):
        piece = flat[s : s + step]
        layout = ChunkedLayout.split(piece.numel(), world, bits, 512, skip)
        key = derive_key(17, STAGE_SCATTER, rank, index)
        sent = maxmin.encode_chunks(piece, layout, key, rank)
        decoded = maxmin.decode_chunks(sent, layout, torch.float32)
        out = expected[s : s + step]
        torch.sub(piece, decoded, out=out)
        start, size = layout.chunk_start(rank), layout.chunk_size(rank)
        out[start : start + size] = 0
    same = expected.view(INT[x.element_size()]) == error.reshape(-1).view(INT[x.element_size()])
    return bool((same | (expected.isnan() & error.reshape(-1).isnan())).all())


def _check_fallback(rank: int, world: int) -> int:
    """Below the crossover the in-place op is NCCL's allreduce itself (called directly, in the
    same synchronous mode as ``dist.all_reduce``): the same bits, SUM and AVG. 1 if not."""
    os.environ["CGX2_CROSSOVER_BYTES"] = str(1 << 40)
    ok = True
    for op, nccl_op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        for dtype in (torch.float32, torch.bfloat16):
            x = _input(rank, 1_000_003, dtype).cuda()
            plain = x.clone()
            dist.all_reduce(plain, op=nccl_op)
            cgx2.quantized_allreduce_(x, 4, op=op)
            ok = ok and torch.equal(
                x.view(INT[x.element_size()]), plain.view(INT[x.element_size()])
            )
    os.environ["CGX2_CROSSOVER_BYTES"] = "0"
    if rank == 0:
        print(
            f"{'ok  ' if ok else 'FAIL'} fallback below the crossover == dist.all_reduce "
            "(sum, avg; fp32, bf16)",
            flush=True,
        )
    flag = torch.tensor([0 if ok else 1], device="cuda")
    dist.all_reduce(flag)
    return int(flag.item())


def _check_deferred(rank: int, world: int) -> int:
    """CUDA tensors on NCCL checked deferred (CGX2_CHECK_AGREEMENT=deferred): ranks that agree
    get the unchecked bytes; ranks that disagree on numel (equal payloads) get NaN and a
    DisagreementError naming it, from the call or the next one. 1 if not."""
    from cgx2.collectives.agreement import DisagreementError

    _tune(check_agreement="deferred")
    x = _input(rank, 1 << 20, torch.float32).cuda()
    checked = cgx2.quantized_allreduce(x, 4, seed=3)
    unchecked = collectives.allreduce(x, dist.group.WORLD, collectives.CallSettings(4, 512, seed=3))
    ok = torch.equal(checked, unchecked)
    y = torch.ones(1024 if rank == 0 else 1000, device="cuda")
    message = ""
    try:
        cgx2.quantized_allreduce_(y, 4)
        cgx2.quantized_allreduce(x, 4)
    except DisagreementError as e:
        message = str(e)
    _settings.close()
    torch.cuda.synchronize()
    ok = ok and "numel=[rank 0: 1024, rank 1: 1000" in message and bool(y.isnan().all())
    if rank == 0:
        print(
            f"{'ok  ' if ok else 'FAIL'} deferred check on NCCL: agreeing ranks unchanged, "
            f"disagreeing ranks NaN and raised ({message[:90]!r})",
            flush=True,
        )
    flag = torch.tensor([0 if ok else 1], device="cuda")
    dist.all_reduce(flag)
    return int(flag.item())


GRAPH_CASES = [
    # bits, dtype, numel, op, pipeline piece bytes (None: the regime's), error feedback
    (4, torch.float32, 4_000_037, "avg", None, False),
    (4, torch.float32, 33_554_467, "avg", None, True),  # 1 to 3 pieces by regime
    (3, torch.bfloat16, 4_000_037, "sum", 1 << 20, True),  # many pieces
]


def _check_graphs(rank: int, world: int) -> int:
    """CUDA-graph replay gives the eager launches' bytes, seed for seed: the first call runs
    eagerly, the second captures, the rest replay with fresh keys read from device memory. 1
    per failed case."""
    failures = 0
    for bits, dtype, n, op, piece, with_error in GRAPH_CASES:
        _tune(pipeline_bytes=piece, cuda_graphs=False)
        x = _input(rank, n, dtype).cuda()
        seeds = (101, 102, 103, 104, 105)
        eager, err_eager = [], []
        for seed in seeds:
            buf, err = x.clone(), torch.empty_like(x) if with_error else None
            collectives.allreduce_(
                buf, dist.group.WORLD, collectives.CallSettings(bits, 512, op, seed), error=err
            )
            eager.append(buf)
            err_eager.append(err)
        _tune(pipeline_bytes=piece, cuda_graphs=True)
        buf, err = torch.empty_like(x), torch.empty_like(x) if with_error else None
        ok, differ = True, False
        for i, seed in enumerate(seeds):
            buf.copy_(x)
            collectives.allreduce_(
                buf, dist.group.WORLD, collectives.CallSettings(bits, 512, op, seed), error=err
            )
            ok = ok and torch.equal(
                buf.view(INT[x.element_size()]), eager[i].view(INT[x.element_size()])
            )
            if with_error:
                ok = ok and torch.equal(
                    err.view(INT[x.element_size()]), err_eager[i].view(INT[x.element_size()])
                )
            differ = differ or (i and not torch.equal(eager[i], eager[0]))
        for _ in range(3):  # each result freed first: the next one lands at its address
            functional = None
            functional = cgx2.quantized_allreduce(x, bits, op=op, seed=seeds[-1])
        ok = ok and torch.equal(
            functional.view(INT[x.element_size()]), eager[-1].view(INT[x.element_size()])
        )
        captured = graphs.stats()["graphs"]
        ok = ok and differ and captured >= 1 and not graphs._CACHE.failed
        _tune(pipeline_bytes=piece)
        graphs.clear()
        if rank == 0:
            say(
                ok,
                f"CUDA graphs: bits={bits} {str(dtype)[6:]} n={n} {op} "
                f"piece={piece or 'regime'} error={with_error}: 5 calls (eager, capture, "
                f"3 replays) == eager launches, seeds apart differ={differ}, "
                f"graphs captured={captured}",
            )
        failures += ranks_failed(ok)
    _settings.close()
    return failures


ALGORITHM_CASES = [
    # bits, dtype, numel, op, pipeline piece bytes (None: the regime's), rotation, CUDA graphs
    # asked for, algorithm
    (4, torch.float32, 1_000_007, "avg", None, None, False, "allgather"),
    (2, torch.bfloat16, 4_000_037, "sum", 1 << 20, "hadamard", False, "allgather"),
    (3, torch.float32, 33_554_467, "avg", None, None, False, "allgather"),
    (4, torch.float32, 4_000_037, "avg", None, None, True, "allgather"),
    # The clipped rotation's reference codes it on the GPU: eager, graphs asked for or not
    (2, torch.float32, 4_000_037, "avg", None, "hadamard-clipped", True, "sra"),
    (3, torch.bfloat16, 1_000_007, "sum", 1 << 20, "hadamard-clipped", False, "allgather"),
]


def _check_algorithms(rank: int, world: int) -> int:
    """CGX2_ALGORITHM=allgather and the clipped rotation: every rank's bytes alike and equal to
    the reference model, eager and (where asked for and possible) replayed as a CUDA graph. 1
    per failed case."""
    failures = 0
    for bits, dtype, n, op, piece, rotation, replay, algorithm in ALGORITHM_CASES:
        _tune(pipeline_bytes=piece, algorithm=algorithm, cuda_graphs=replay)
        x = _input(rank, n, dtype).cuda()
        replayed_before = graphs.stats()["replays"]
        calls = 3 if replay else 1  # eager, capture, replay
        for _ in range(calls):
            out = None
            out = cgx2.quantized_allreduce(x, bits, op=op, seed=23, rotation=rotation)
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out)
        ints = INT[x.element_size()]
        ok = all(torch.equal(o.view(ints), out.view(ints)) for o in outs)
        replays = graphs.stats()["replays"] - replayed_before
        if rotation == "hadamard-clipped":
            ok = ok and replays == 0
        elif replay:
            ok = ok and replays >= 1 and not graphs._CACHE.failed
        if rank == 0:
            inputs = [_input(r, n, dtype) for r in range(world)]
            model = collectives.reference_allreduce(  # under _tune's pieces, as the call
                inputs,
                bits,
                512,
                23,
                op,
                device=x.device,
                rotation=rotation,
                gather_all=algorithm == "allgather",
            )
            diff = out.cpu().view(ints) != model.view(ints)
            ok = ok and not bool(diff.any())
            say(
                ok,
                f"{algorithm}: bits={bits} {str(dtype)[6:]} n={n} {op} rotation={rotation} "
                f"graphs={replay} (replays {replays}): ranks identical, differ from "
                f"model={int(diff.sum())}",
            )
        graphs.clear()
        failures += ranks_failed(ok)
    _settings.close()
    return failures


def main() -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    failures = 0
    for bits, dtype, n, op, skip, piece in CASES:
        _tune(pipeline_bytes=None if piece is None else piece or 64 << 20)
        x = _input(rank, n, dtype).cuda()
        out = cgx2.quantized_allreduce(x, bits, op=op, seed=17, skip_incomplete=skip)
        in_place = x.clone()
        cgx2.quantized_allreduce_(in_place, bits, op=op, seed=17, skip_incomplete=skip)
        with_error = x.clone()
        error = torch.empty_like(x)  # the first stage's error, as error feedback reads it
        settings = collectives.CallSettings(bits, 512, op, 17, skip)
        collectives.allreduce_(with_error, dist.group.WORLD, settings, error=error)
        in_place_same = torch.equal(
            with_error.view(INT[x.element_size()]), in_place.view(INT[x.element_size()])
        )
        same_in_place = torch.equal(
            in_place.view(INT[x.element_size()]), out.view(INT[x.element_size()])
        )
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out)
        same = all(
            torch.equal(o.view(INT[o.element_size()]), out.view(INT[o.element_size()]))
            for o in outs
        )
        same = same and same_in_place and in_place_same
        ok = same
        if rank == 0:
            inputs = [_input(r, n, dtype) for r in range(world)]
            model = collectives.reference_allreduce(
                inputs, bits, 512, 17, op, skip, device=x.device
            )
            got = out.cpu()
            exact = model.view(INT[model.element_size()])
            diff = got.view(INT[got.element_size()]) != exact
            diff &= ~(got.isnan() & model.isnan())
            ok = same and not bool(diff.any())
            # The error is this rank's input minus its chunks as the owners decode them: the
            # CPU reference codec decoding the same bytes must agree to the bit.
            ok = ok and _error_matches(x.cpu(), error.cpu(), bits, skip, world, rank)
            err = got.double() - sum(i.double() for i in inputs) / (world if op == "avg" else 1)
            cut = "regime" if piece is None else piece or "64M"
            say(
                ok,
                f"bits={bits} {str(dtype)[6:]} n={n} {op} skip={skip} piece={cut}: ranks and "
                f"in-place identical={same}, differ from model={int(diff.sum())}, "
                f"max|err|={err.abs().max():.4g}",
            )
        failures += ranks_failed(ok)
    _settings.close()
    failures += _check_fallback(rank, world)
    failures += _check_graphs(rank, world)
    failures += _check_deferred(rank, world)
    failures += _check_algorithms(rank, world)
    total = len(CASES) + 2 + len(GRAPH_CASES) + len(ALGORITHM_CASES)
    if rank == 0:
        print(
            f"allreduce check on {world} x {torch.cuda.get_device_name()}: "
            f"{total - failures} of {total} cases ok"
        )
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
