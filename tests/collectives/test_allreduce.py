"""cgx.quantized_allreduce on gloo groups of 2 and 4: identical results on every rank, error
within the two-stage bound, unbiasedness, plain fallback, compile and opcheck."""

import importlib

import pytest
import torch
import torch.distributed as dist
from bounds import FP32_EPS, allreduce_bound

import cgx2
from cgx2.collectives import CallSettings, allreduce_, policy, reference_allreduce
from cgx2.config import tuned

# The module, which the package's function of the same name hides.
pipeline = importlib.import_module("cgx2.collectives.allreduce")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _input(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return (torch.randn(n, generator=g) * (rank + 1) + rank).to(dtype)


# ----------------------------------------------------------------- functions run on every rank


def _run_cases(cases: list[tuple]) -> list[torch.Tensor]:
    rank = dist.get_rank()
    outs = []
    for bits, dtype, n, op, skip in cases:
        x = _input(rank, n, dtype)
        before = x.clone()
        out = cgx2.quantized_allreduce(x, bits, op=op, seed=17, skip_incomplete=skip)
        assert torch.equal(x, before), "input was modified"
        outs.append(out)
    return outs


def _run_pipelined(cases: list[tuple], piece_bytes: int, pair_gather: bool) -> list[torch.Tensor]:
    with tuned(pipeline_bytes=piece_bytes, pair_gather=pair_gather):
        return _run_cases(cases)


def _plain_equals_dist_all_reduce() -> list[bool]:
    """Through the process group, bits 32 is ``dist.all_reduce``'s result; through shared
    memory, the sum in rank order (each chunk summed by one rank, whose bytes all copy)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for dtype in DTYPES:
        x = _input(rank, 1000, dtype)
        with tuned(transport="process_group"):
            expected = x.clone()
            dist.all_reduce(expected)
            results.append(torch.equal(cgx2.quantized_allreduce(x, bits=32), expected))
            results.append(
                torch.equal(cgx2.quantized_allreduce(x, 32, op=dist.ReduceOp.AVG), expected / world)
            )
        gathered = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(gathered, x)
        in_order = gathered[0] + gathered[1]
        for other in gathered[2:]:
            in_order += other
        with tuned(transport="shm"):
            results.append(torch.equal(cgx2.quantized_allreduce(x, bits=32), in_order))
            results.append(
                torch.equal(cgx2.quantized_allreduce(x, 32, op=dist.ReduceOp.AVG), in_order / world)
            )
    return results


def _seeds() -> list[torch.Tensor]:
    x = _input(dist.get_rank(), 3000, torch.float32)
    cgx2.manual_seed(0)
    return [
        cgx2.quantized_allreduce(x, 2, seed=5),
        cgx2.quantized_allreduce(x, 2, seed=5),
        cgx2.quantized_allreduce(x, 2, seed=6),
        cgx2.quantized_allreduce(x, 2),
        cgx2.quantized_allreduce(x, 2),
    ]


def _unbiased_samples(n: int, samples: int) -> torch.Tensor:
    x = _input(dist.get_rank(), n, torch.float32)
    return torch.stack([cgx2.quantized_allreduce(x, 2, seed=s) for s in range(samples)])


def _groups() -> tuple[torch.Tensor, torch.Tensor, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(world)]
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    x = _input(rank, 2000, torch.float32)
    alone = cgx2.quantized_allreduce(x, 4, group=singles[rank])
    pair = cgx2.quantized_allreduce(x, 4, group=pairs[rank // 2], seed=3)
    return alone, pair, pairs[rank // 2].group_name


def _shapes() -> list[torch.Tensor]:
    x = _input(dist.get_rank(), 6 * 700, torch.float32).view(6, 700)
    return [
        cgx2.quantized_allreduce(x, 4, seed=1),
        cgx2.quantized_allreduce(x.t(), 4, seed=1),  # non-contiguous
        cgx2.quantized_allreduce(x.reshape(-1), 4, seed=1),
    ]


def _in_place() -> list[bool]:
    """quantized_allreduce_ writes the functional op's bytes into its input: any dtype,
    non-contiguous inputs, many pipeline pieces; opcheck of the mutating op."""
    rank, ok = dist.get_rank(), []
    for dtype in DTYPES:
        x = _input(rank, 3000, dtype)
        y = x.clone()
        returned = cgx2.quantized_allreduce_(y, 4, op="avg", seed=3)
        ok.append(
            returned is y and _bits_equal(y, cgx2.quantized_allreduce(x, 4, op="avg", seed=3))
        )
    x = _input(rank, 6 * 700, torch.float32).view(6, 700).t()
    y = x.clone()
    cgx2.quantized_allreduce_(y, 4, seed=1)
    ok.append(not y.is_contiguous() and torch.equal(y, cgx2.quantized_allreduce(x, 4, seed=1)))
    with tuned(pipeline_bytes=8 << 10):
        x = _input(rank, 40_000, torch.float32)  # 20 pieces, each written after its last read
        y = x.clone()
        cgx2.quantized_allreduce_(y, 3, seed=2)
        ok.append(torch.equal(y, cgx2.quantized_allreduce(x, 3, seed=2)))
    torch.library.opcheck(torch.ops.cgx.quantized_allreduce_.default, (x, 4, 512, "", "sum", 5))
    return ok


def _opcheck() -> bool:
    x = _input(dist.get_rank(), 2500, torch.float32)
    name = dist.group.WORLD.group_name
    torch.library.opcheck(torch.ops.cgx.quantized_allreduce.default, (x, 4, 512, name, "sum", 5))
    torch.library.opcheck(
        torch.ops.cgx.quantized_allreduce.default, (x.bfloat16(), 3, 100, "", "avg", 5, True)
    )
    return True


def _compiled_vs_eager() -> tuple[bool, bool, int, int]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    name = dist.group.WORLD.group_name

    def step(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.cgx.quantized_allreduce(x * 2, 4, 512, name, "avg", 99, False)
        return y.relu() + 1

    def wrapper_step(x: torch.Tensor) -> torch.Tensor:
        return cgx2.quantized_allreduce(x * 2 + 1, bits=3, op=dist.ReduceOp.SUM, seed=7)

    def in_place_step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        cgx2.quantized_allreduce_(y, bits=4, seed=5)
        return y + 1

    x = _input(dist.get_rank(), 4000, torch.float32).view(40, 100)
    same = torch.equal(torch.compile(step, fullgraph=True)(x), step(x))
    same_wrapper = torch.equal(torch.compile(wrapper_step, fullgraph=True)(x), wrapper_step(x))
    same_in_place = torch.equal(torch.compile(in_place_step, fullgraph=True)(x), in_place_step(x))
    return (
        same and same_in_place,
        same_wrapper,
        sum(counters["graph_break"].values()),
        counters["stats"]["unique_graphs"],
    )


# ----------------------------------------------------------------------------------- tests


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


def _check(outs_by_rank: list[list[torch.Tensor]], cases: list[tuple], world: int) -> None:
    """Same bits on every rank, equal to the single-process model, within the error bound."""
    for i, (bits, dtype, n, op, skip) in enumerate(cases):
        outs = [r[i] for r in outs_by_rank]
        assert all(o.dtype == dtype and o.shape == (n,) for o in outs), cases[i]
        assert all(_bits_equal(o, outs[0]) for o in outs), f"ranks differ: {cases[i]}"
        inputs = [_input(r, n, dtype) for r in range(world)]
        model = reference_allreduce(inputs, bits, 512, seed=17, reduce_op=op, skip_incomplete=skip)
        assert _bits_equal(outs[0], model), f"differs from reference_allreduce: {cases[i]}"
        exact = torch.stack([x.double() for x in inputs]).sum(0)
        bound = allreduce_bound(inputs, bits, 512, dtype)
        if op == "avg":
            exact, bound = exact / world, bound / world + 2 * FP32_EPS * exact.abs() / world
        err = (outs[0].double() - exact).abs()
        assert (err <= bound).all(), f"{cases[i]}: err {err.max()} > bound {bound[err.argmax()]}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_bits_and_lengths_two_ranks(dist2, dtype):
    cases = [
        (bits, dtype, n, op, skip)
        for bits in range(1, 9)
        for n in (0, 1, 1009, 2 * 2 * 512 + 7)
        for op, skip in (("sum", False), ("avg", n == 1009))
    ]
    _check(dist2.run(_run_cases, cases), cases, 2)


def test_all_bits_four_ranks(dist4):
    cases = [
        (bits, dtype, n, op, False)
        for bits in (1, 3, 4, 8)
        for dtype in DTYPES
        for n in (1, 4 * 4 * 512 + 7, 10007)
        for op in ("sum", "avg")
    ]
    _check(dist4.run(_run_cases, cases), cases, 4)


def test_a_few_million_values(dist2):
    cases = [
        (4, torch.float32, 2_500_007, "sum", False),
        (8, torch.bfloat16, 2_000_001, "avg", True),
    ]
    _check(dist2.run(_run_cases, cases), cases, 2)


@pytest.mark.parametrize("world, pair_gather", [(2, True), (2, False), (4, True)])
def test_pipelined_pieces(dist2, dist4, world, pair_gather):
    """Small pieces: many in flight at once, the last one short; same guarantees, whether two
    ranks swap their chunks by all-gather or all-to-all."""
    pool = dist2 if world == 2 else dist4
    piece_bytes = 4 * 512 * world
    cases = [
        (bits, dtype, n, op, skip)
        for bits, dtype in ((2, torch.float32), (5, torch.bfloat16), (8, torch.float16))
        for n in (1, 8 * 512 * world + 123, 20 * 512 * world)
        for op, skip in (("sum", False), ("avg", True))
    ]
    outs = pool.run(_run_pipelined, cases, piece_bytes, pair_gather)
    with tuned(pipeline_bytes=piece_bytes, pair_gather=pair_gather):
        _check(outs, cases, world)


def test_bits_32_is_the_plain_allreduce_exactly(dist2, dist4):
    """No value is quantized: the transport's own sum, exactly."""
    assert all(all(r) for r in dist2.run(_plain_equals_dist_all_reduce))
    assert all(all(r) for r in dist4.run(_plain_equals_dist_all_reduce))


def test_seed_reproduces_and_unseeded_calls_differ_but_agree(dist2):
    r0, r1 = dist2.run(_seeds)
    for a, b in zip(r0, r1, strict=True):
        assert torch.equal(a, b)
    same_seed, again, other_seed, unseeded1, unseeded2 = r0
    assert torch.equal(same_seed, again)
    assert not torch.equal(same_seed, other_seed)
    assert not torch.equal(unseeded1, unseeded2)


def test_unbiased(dist2):
    n, samples = 2048, 400
    r0, r1 = dist2.run(_unbiased_samples, n, samples)
    assert torch.equal(r0, r1)
    inputs = [_input(r, n, torch.float32) for r in range(2)]
    exact = inputs[0].double() + inputs[1].double()
    err = r0.double() - exact
    # Each stage rounds stochastically within one step: variance <= (sum of steps)^2 / 4.
    sigma = allreduce_bound(inputs, 2, 512, torch.float32) / 2 / samples**0.5
    assert (err.mean(0).abs() <= 6 * sigma).all()
    assert abs(err.mean(0).sum().item()) <= 6 * (sigma**2).sum().sqrt().item()


def test_subgroups_and_group_of_one(dist4):
    results = dist4.run(_groups)
    for rank, (alone, _, _) in enumerate(results):
        assert torch.equal(alone, _input(rank, 2000, torch.float32))  # a group of one: a copy
    for a, b in ((0, 1), (2, 3)):
        assert torch.equal(results[a][1], results[b][1])
        exact = _input(a, 2000, torch.float32).double() + _input(b, 2000, torch.float32).double()
        inputs = [_input(a, 2000, torch.float32), _input(b, 2000, torch.float32)]
        assert (
            (results[a][1].double() - exact).abs() <= allreduce_bound(inputs, 4, 512, torch.float32)
        ).all()
    assert results[0][2] != results[2][2]


def test_shape_preserved_and_non_contiguous_input(dist2):
    r0, r1 = dist2.run(_shapes)
    for a, b in zip(r0, r1, strict=True):
        assert torch.equal(a, b)
    assert r0[0].shape == (6, 700) and r0[1].shape == (700, 6)
    assert torch.equal(r0[0].reshape(-1), r0[2])


def test_in_place_variant(dist2, dist4):
    for pool in (dist2, dist4):
        for ok in pool.run(_in_place):
            assert all(ok) and len(ok) == 5, ok


def _gradients() -> tuple[dict[int, torch.Tensor], str]:
    rank = dist.get_rank()
    x = _input(rank, 3000, torch.float32).requires_grad_()
    weights = torch.linspace(-1, 1, 3000) * (rank + 1)
    grads = {}
    for bits in (32, 8):
        x.grad = None
        y = cgx2.quantized_allreduce(x, bits, op="avg")
        (y * weights).sum().backward()
        grads[bits] = x.grad.clone()
    try:
        cgx2.quantized_allreduce_(x, 4)
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    return grads, error


def test_the_gradient_is_the_allreduce_of_the_outputs_gradients(dist2):
    """d(sum_r w_r . avg(x))/dx = avg(w): exact at 32 bits, within 8 bits' bound, the same on
    every rank; the in-place variant, which records no gradient, refuses such an input."""
    (grads0, error0), (grads1, error1) = dist2.run(_gradients)
    expected = torch.linspace(-1, 1, 3000) * 1.5
    assert torch.allclose(grads0[32], expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(grads0[8], grads1[8]) and torch.equal(grads0[32], grads1[32])
    assert 0 < (grads0[8] - expected).abs().max() < 2 * 3 / 255  # two 8-bit steps of the range
    assert "no gradient" in error0 and "no gradient" in error1


def test_opcheck_on_the_collective(dist2):
    assert dist2.run(_opcheck) == [True, True]


def test_compile_fullgraph_matches_eager(dist2):
    for same, same_wrapper, graph_breaks, graphs in dist2.run(_compiled_vs_eager):
        assert same and same_wrapper
        assert graph_breaks == 0
        assert graphs == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bits": 0}, ValueError, "bits"),
        ({"bits": 9}, ValueError, "bits"),
        ({"bits": 33}, ValueError, "bits"),
        ({"bucket_size": 0}, ValueError, "bucket_size"),
        ({"bucket_size": 2**31 - 1}, ValueError, r"bucket_size must be in 1\.\.1048576"),
        ({"op": dist.ReduceOp.MAX}, ValueError, "op"),
        ({"op": "product"}, ValueError, "op"),
    ],
)
def test_bad_arguments_fail_before_any_communication(kwargs, error, match):
    with pytest.raises(error, match=match):
        cgx2.quantized_allreduce(torch.randn(10), **{"bits": 4, **kwargs})


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.complex64])
def test_non_float_tensors_are_rejected(dtype):
    with pytest.raises(TypeError, match="input must have dtype"):
        torch.ops.cgx.quantized_allreduce(torch.zeros(10, dtype=dtype), 4)


@pytest.mark.parametrize("where", ["socket", "shm", "nvlink"])
def test_pieces_follow_the_regime(where):
    """Without CGX2_PIPELINE_BYTES, a piece holds the regime's PIECE_NUMEL values, whatever
    the dtype, or, where two ranks swap by all-gather, PIECE_NUMEL_PAIR's."""
    plain = policy.PIECE_NUMEL[where]
    pair = policy.PIECE_NUMEL_PAIR.get(where, plain)
    with tuned(pipeline_bytes=None):
        for element_size in (2, 4):
            assert policy.piece_numel(element_size, 4, 512, where, False) == plain
            assert policy.uses_pair_gather(2, where) == (where != "nvlink")
            two = policy.uses_pair_gather(2, where)
            assert policy.piece_numel(element_size, 2, 512, where, two) == pair
            with tuned(pair_gather=False):
                assert not policy.uses_pair_gather(2, where)
                assert policy.piece_numel(element_size, 2, 512, where, False) == plain
    assert policy.PIECE_NUMEL_PAIR["socket"] > policy.PIECE_NUMEL["socket"]
    with tuned(pipeline_bytes=1 << 20):
        assert policy.piece_numel(4, 4, 512, "nvlink", False) == (1 << 18)


def test_cpu_tensors_of_a_job_across_nodes_take_smaller_pieces(monkeypatch):
    """On one host the CPU codec bounds the call and one large piece costs least; across nodes
    the link does, and smaller pieces keep it busy while the next is coded, except beside the
    training step, where one piece a bucket trained faster."""
    with tuned(pipeline_bytes=None):
        assert policy.piece_numel(4, 2, 512, "cpu", True) == policy.PIECE_NUMEL["cpu"]
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        across = policy.CPU_ACROSS_NODES_PIECE_NUMEL
        assert across < policy.PIECE_NUMEL["cpu"]
        assert policy.piece_numel(4, 2, 512, "cpu", True) == across
        assert policy.piece_numel(2, 4, 512, "cpu", False) == across
        assert policy.piece_numel(4, 4, 512, "socket", False) == policy.PIECE_NUMEL["socket"]
        # Beside the training step (DDP's hooks, on their worker) one piece a bucket.
        assert (
            policy.piece_numel(4, 2, 512, "cpu", True, beside_compute=True)
            == policy.PIECE_NUMEL["cpu"]
        )


def test_extend_key_continues_derive_key():
    """The pipeline derives each stage's key prefix once per call and extends it per piece:
    the keys must be the ones the reference model derives whole."""
    from cgx2.seeding import derive_key, extend_key

    for seed in (0, 17, 2**63 - 25):
        assert extend_key(derive_key(seed, 1, 3), 9) == derive_key(seed, 1, 3, 9)
        assert extend_key(derive_key(seed, 2), 0, 5) == derive_key(seed, 2, 0, 5)
    assert extend_key(123) == 123


def test_call_seed_stream_restarts_resumes_and_rejects_foreign_state():
    from cgx2 import seeding

    cgx2.manual_seed(42)
    first = [seeding.next_seed() for _ in range(3)]
    assert len(set(first)) == 3 and all(0 <= s < 2**63 for s in first)
    mask = (1 << 64) - 1
    z = (42 + 2 * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & mask  # SplitMix64, third draw
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    assert first == [seeding.call_seed(42, k) for k in range(3)]
    assert first[2] == (z ^ (z >> 31)) >> 1
    state = seeding.get_state()
    later = [seeding.next_seed() for _ in range(2)]
    cgx2.manual_seed(42)
    assert [seeding.next_seed() for _ in range(3)] == first
    seeding.set_state(state)
    assert [seeding.next_seed() for _ in range(2)] == later
    cgx2.manual_seed(43)
    assert seeding.next_seed() not in first
    with pytest.raises(ValueError, match="16-byte state"):
        seeding.set_state(torch.Generator().get_state())


def _collective_modes(name: str) -> list[list[bool]]:
    """The async_op each pipeline collective of transport ``name`` got: one piece, one piece
    with error feedback, three pieces; each call's result checked against the model."""
    seen: list[bool] = []
    transport = importlib.import_module(f"cgx2.comm.{name}")
    all_to_all, all_gather = transport.all_to_all, transport.all_gather

    def record(fn):
        def wrapper(*args, **kwargs):
            seen.append(args[-1] if isinstance(args[-1], bool) else kwargs.get("async_op", True))
            return fn(*args, **kwargs)

        return wrapper

    transport.all_to_all = record(all_to_all)  # exchange() calls one of the two
    transport.all_gather = record(all_gather)
    modes = []
    try:
        rank = dist.get_rank()
        for piece_bytes, with_error in ((None, False), (None, True), (4 * 1024 * 4, False)):
            with tuned(pipeline_bytes=piece_bytes, transport=name):
                seen.clear()
                x = torch.randn(3 * 4096, generator=torch.Generator().manual_seed(rank))
                error = torch.empty_like(x) if with_error else None
                got = allreduce_(
                    x.clone(), dist.group.WORLD, CallSettings(4, 512, seed=7), error=error
                )
                inputs = [
                    torch.randn(3 * 4096, generator=torch.Generator().manual_seed(r))
                    for r in range(dist.get_world_size())
                ]
                assert torch.equal(got, reference_allreduce(inputs, 4, 512, 7))
                modes.append(list(seen))
    finally:
        transport.all_to_all, transport.all_gather = all_to_all, all_gather
    return modes


@pytest.mark.parametrize("name", ["process_group", "shm"])
def test_collectives_overlap_only_where_there_is_something_to_overlap(dist2, name):
    """One piece, nothing to overlap: its collectives run on the caller's stream (less host
    time on NCCL); with error feedback (decoded while the chunks travel) or several pieces,
    asynchronously. The bytes are the model's either way."""
    for modes in dist2.run(_collective_modes, name):
        assert modes == [[False, False], [True, True], [True] * 6]


def _gathered_in_place() -> list[bool]:
    """Each piece's all-gather with ``gather_in_place`` forced (what a group on NCCL gets):
    whether its input is its output's slot of this rank, the result checked against the
    model (gloo and shared memory gather in place too)."""
    slots: list[bool] = []
    from cgx2.comm import process_group as transport

    all_gather, make_run = transport.all_gather, pipeline._make_run

    def record(out, send, group, async_op=True):
        rank, nbytes = dist.get_rank(), send.numel()
        slots.append(send.data_ptr() == out.data_ptr() + rank * nbytes)
        return all_gather(out, send, group, async_op)

    def in_place(*args, **kwargs):
        run = make_run(*args, **kwargs)
        run.gather_in_place = True
        return run

    transport.all_gather, pipeline._make_run = record, in_place
    try:
        with tuned(pipeline_bytes=4 * 1024 * 4, pair_gather=False, transport="process_group"):
            rank, n = dist.get_rank(), 3 * 4096 + 77
            inputs = [
                torch.randn(n, generator=torch.Generator().manual_seed(r))
                for r in range(dist.get_world_size())
            ]
            got = allreduce_(inputs[rank].clone(), dist.group.WORLD, CallSettings(4, 512, seed=7))
            assert torch.equal(got, reference_allreduce(inputs, 4, 512, 7))
    finally:
        transport.all_gather, pipeline._make_run = all_gather, make_run
    return slots


def test_reduced_chunks_gather_in_place(dist2):
    """On NCCL each rank encodes its reduced chunk straight into its slot of the gather's
    output, which NCCL then gathers in place; the bytes stay the model's."""
    for slots in dist2.run(_gathered_in_place):
        assert slots == [True] * 4


# ------------------------------------------------------------------- sums that overflow fp32

_OVERFLOW_N = 6 * 512  # chunk 0 (buckets 0-2) is rank 0's, chunk 1 (buckets 3-5) rank 1's


def _overflow_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Per bucket of 512: 0, a sum past +FLT_MAX; 1, past -FLT_MAX; 2, that and +Inf in rank
    0's (the owner's) input; 3, both ways; 4, -Inf in rank 0's input (not the owner's);
    5, ordinary values only. fp16 values overflow fp16 only, once summed."""
    huge = 6e4 if dtype == torch.float16 else 3e38
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(_OVERFLOW_N, generator=g, dtype=torch.float64) * (rank + 1)
    x[0:9] = x[1030:1040] = x[1540:1550] = huge
    x[520:530] = x[1550:1560] = -huge
    x[1560:1563] = huge * (1 - 2 * rank)  # sums to zero
    x[1040] = float("inf") if rank == 0 else 1.0
    x[2050] = -float("inf") if rank == 0 else 1.0
    return x.to(dtype)


def _overflowing_sums(cases: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rank, world, outs = dist.get_rank(), dist.get_world_size(), []
    for bits, dtype, op in cases:
        x = _overflow_input(rank, dtype)
        plain = x / world if op == "avg" else x.clone()  # gloo's AVG divides first, as DDP
        dist.all_reduce(plain)
        outs.append((plain, cgx2.quantized_allreduce(x, bits, op=op, seed=17)))
    return outs


def test_a_sum_that_overflows_is_inf_where_the_plain_allreduce_is(dist2):
    """The plain allreduce's +-Inf where two ranks' finite values sum past the dtype's range
    (not where they average within it); the other values of those buckets finite and within
    the bound; input +-Inf still NaN (its whole bucket), and at 1 bit a bucket overflowing
    both ways (which one bit a value cannot code); every rank the model's bits."""
    cases = [(b, dtype, op) for b in (1, 2, 4, 8) for dtype in DTYPES for op in ("sum", "avg")]
    results = dist2.run(_overflowing_sums, cases)
    for i, (bits, dtype, op) in enumerate(cases):
        (plain, out), (_, other) = results[0][i], results[1][i]
        inputs = [_overflow_input(r, dtype) for r in range(2)]
        assert _bits_equal(out, other), f"ranks differ: {cases[i]}"
        model = reference_allreduce(inputs, bits, 512, seed=17, reduce_op=op)
        assert _bits_equal(out, model), cases[i]
        nan = torch.zeros(_OVERFLOW_N, dtype=torch.bool)
        nan[1024:1536] = nan[2048:2560] = True
        if bits == 1 and dtype != torch.float16 and op == "sum":
            nan[1536:2048] = True
        assert out[nan].isnan().all(), cases[i]
        assert not out[~nan].isnan().any(), cases[i]
        infinite = plain.isinf() & ~nan
        assert infinite.sum() >= (19 if op == "sum" else 0), cases[i]
        assert torch.equal(out[infinite], plain[infinite]), cases[i]
        exact = torch.stack([x.double() for x in inputs]).sum(0)
        bound = allreduce_bound([x.double().nan_to_num(0.0) for x in inputs], bits, 512, dtype)
        if op == "avg":
            exact, bound = exact / 2, bound / 2 + 2 * FP32_EPS * exact.abs() / 2
        # Finite where the plain sum is; in a 16-bit dtype, where the bound cannot reach past
        # its range (fp16 at 1 bit: each value decodes to its bucket's min or max sum).
        fits = exact.abs() + bound <= torch.finfo(dtype).max
        finite = ~nan & ~infinite & (fits | (dtype == torch.float32))
        assert out[finite].isfinite().all(), cases[i]
        err = (out[finite].double() - exact[finite]).abs()
        assert (err <= bound[finite]).all(), f"{cases[i]}: err {err.max()}"


def _overflowing_sums_of_four() -> list[tuple[torch.Tensor, torch.Tensor]]:
    rank, outs = dist.get_rank(), []
    x = _input(rank, 8 * 512, torch.float32)
    x[100:110] = x[1500:1510] = x[3000:3003] = 3e38  # every rank's chunk has some
    x[600:610] = x[1510:1520] = x[3900:3901] = -3e38
    for op in ("sum", "avg"):
        plain = x / 4 if op == "avg" else x.clone()
        dist.all_reduce(plain)
        outs.append((plain, cgx2.quantized_allreduce(x, 3, op=op, seed=5)))
    return outs


def test_four_ranks_whose_sum_overflows(dist4):
    """Four ranks, each owning an overflowing chunk: +-Inf where the plain sum is, the plain
    AVG's finite mean finite, no NaN, the model's bits on every rank."""
    results = dist4.run(_overflowing_sums_of_four)
    inputs = [_input(r, 8 * 512, torch.float32) for r in range(4)]
    for x in inputs:
        x[100:110] = x[1500:1510] = x[3000:3003] = 3e38
        x[600:610] = x[1510:1520] = x[3900:3901] = -3e38
    for i, op in enumerate(("sum", "avg")):
        plain, out = results[0][i]
        assert all(_bits_equal(r[i][1], out) for r in results)
        assert _bits_equal(out, reference_allreduce(inputs, 3, 512, seed=5, reduce_op=op))
        assert not out.isnan().any()
        assert torch.equal(out.isposinf(), plain.isposinf())
        assert torch.equal(out.isneginf(), plain.isneginf())
        assert plain.isinf().sum() == (44 if op == "sum" else 0)
