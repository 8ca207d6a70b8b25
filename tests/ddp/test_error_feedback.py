"""Error feedback: residual algebra exact (collective, Global-QSGD functions, DDP steps), the
time-averaged error shrinks, keys survive DDP's bucket rebuild, checkpoints resume exactly."""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx2
from cgx2.codecs import ChunkedLayout, maxmin
from cgx2.collectives import CallSettings, allreduce_, policy
from cgx2.collectives.allreduce import STAGE_SCATTER
from cgx2.config import tuned
from cgx2.ddp import (
    CGXState,
    GlobalQSGDState,
    cgx_hook,
    standard_dithering_4bit_hook,
    standard_dithering_hook,
)
from cgx2.ddp import global_qsgd as gq
from cgx2.ddp.error_feedback import ErrorFeedback
from cgx2.seeding import derive_key

BITS, BUCKET = 4, 64


# ------------------------------------------------------------------------------ the class


def test_keys_are_stable_and_in_order_of_first_sight():
    a, b, c = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    ef = ErrorFeedback()
    assert ef.keys([b, a]) == [0, 1] and ef.keys([a, c, b]) == [1, 2, 0]
    assert ef.residual(0) is None and ef.add_(0, torch.ones(3)).tolist() == [1, 1, 1]


def test_add_update_store_and_state_dict_round_trip():
    ef = ErrorFeedback()
    sent = torch.tensor([1.0, 2.0, 3.0])
    ef.update_(0, sent, torch.tensor([1.5, 2.0, 2.0]))
    ef.store_(1, torch.tensor([[0.25, -0.25]]))
    assert ef.residual(0).tolist() == [-0.5, 0.0, 1.0]
    grad = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    assert ef.add_(1, grad).tolist() == [[1.25, 0.75]]
    buffer = io.BytesIO()
    torch.save(ef.state_dict(), buffer)
    buffer.seek(0)
    other = ErrorFeedback()
    other.load_state_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(other.residual(0), ef.residual(0))
    assert other.add_(0, torch.zeros(3, dtype=torch.float64)).tolist() == [-0.5, 0.0, 1.0]
    assert other.residual(0).dtype == torch.float64  # moved to its layer's dtype (and device)
    ef.discard_(0)
    assert ef.residual(0) is None


def test_many_at_once_equals_one_by_one():
    """add_many_/store_many_ (one _foreach add, one nan_to_num of the shared buffer) keep
    what add_/store_ keep, one layer at a time; a layer without a residual is left alone."""
    one, many = ErrorFeedback(), ErrorFeedback()
    errors = torch.tensor([0.5, float("nan"), -1.0, float("inf"), 2.0, 0.25])
    spans = [(0, 2), (2, 3), (5, 1)]
    for key, (s, n) in enumerate(spans):
        one.store_(key, errors[s : s + n].clone())
    buffer = errors.clone()
    many.store_many_([0, 1, 2], [buffer[s : s + n] for s, n in spans])
    for key in range(3):
        assert torch.equal(many.residual(key), one.residual(key))
    assert torch.isfinite(buffer).all()  # zeroed in place, once
    grads = torch.arange(8, dtype=torch.float64)
    expected = grads.clone()
    for key, (s, n) in zip([0, 2, 7], [(0, 2), (3, 1), (5, 3)], strict=True):
        one.add_(key, expected[s : s + n])
    many.add_many_([0, 2, 7], [grads[0:2], grads[3:4], grads[5:8]])
    assert torch.equal(grads, expected)
    with pytest.raises(ValueError, match="residual of key 1 has 3 values, its layer 2"):
        many.add_many_([1], [torch.zeros(2)])


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="residual of key 0 has 3 values, its layer 4"):
        ef = ErrorFeedback()
        ef.store_(0, torch.zeros(3))
        ef.add_(0, torch.zeros(4))
    with pytest.raises(TypeError, match="residuals"):
        ErrorFeedback().load_state_dict({"residuals": {0: [1.0]}})
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        CGXState(None, error_feedback="yes")
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        GlobalQSGDState(error_feedback=1)
    with pytest.raises(ValueError, match="hierarchical mesh"):
        CGXState(
            None,
            compression_params={"bits": 4},
            mesh=DeviceMesh.__new__(DeviceMesh),
            error_feedback=True,
        )
    with pytest.raises(ValueError, match="error must be"):
        allreduce_(torch.zeros(8), None, CallSettings(4, 4), error=torch.zeros(4))
    state = CGXState(None, 16, {"bits": 4}, error_feedback=True)
    grad = torch.zeros(64, 64)
    with pytest.raises(NotImplementedError, match="compiled autograd"):
        cgx_hook(state, (grad, nn.Parameter(grad)))


# --------------------------------------------------------------- functions run on every rank


def _collective_error(dtype: torch.dtype) -> dict:
    """The allreduce's ``error`` against an independent encode/decode of what this rank
    sends, over several pipeline pieces; and the result is unchanged by asking for it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # Pieces of 256 (fp32) or 1024 values: several a call.
    with tuned(pipeline_bytes=2048):
        g = torch.Generator().manual_seed(40 + rank)
        x = (torch.randn(1500, generator=g) * (rank + 1)).to(dtype)
        plain = x.clone()
        allreduce_(plain, dist.group.WORLD, CallSettings(BITS, BUCKET, "avg", 77))
        out, error = x.clone(), torch.full_like(x, float("nan"))
        allreduce_(out, dist.group.WORLD, CallSettings(BITS, BUCKET, "avg", 77), error=error)
        step = policy.route(x, dist.group.WORLD, BITS, BUCKET).piece_numel
        decoded = x.float().clone()
        for i, s in enumerate(range(0, x.numel(), step)):
            piece = x[s : s + step]
            layout = ChunkedLayout.split(piece.numel(), world, BITS, BUCKET, False)
            key = derive_key(77, STAGE_SCATTER, rank, i)
            for j in range(world):
                a, n = layout.chunk_start(j), layout.chunk_size(j)
                if j != rank and n:
                    payload = maxmin.encode(piece[a : a + n], BITS, BUCKET, key, j)
                    decoded[s + a : s + a + n] = maxmin.decode(payload, n, BITS, BUCKET)
        return {
            "same": torch.equal(out, plain),
            "error": error,
            "x": x,
            "decoded": decoded,
            "pieces": -(-x.numel() // step),
        }


def _gq_algebra(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Global-QSGD function's average against the average of (input − residual)."""
    g = torch.randn(500, generator=torch.Generator().manual_seed(50 + dist.get_rank()))
    residual = torch.empty_like(g)
    out = getattr(gq, name)(g, GlobalQSGDState(None, 4), residual=residual)
    contribution = g - residual
    dist.all_reduce(contribution)
    return out, contribution / dist.get_world_size()


class Permuted(nn.Module):
    """Three 64x64 weights (compressed by cgx_hook) and a bias (exact); the loss is linear in
    them, so the gradient is the coefficients whatever the weights. The gradients become
    ready out of registration order: DDP's rebuilt buckets differ from its first one."""

    order = ("b", "c", "a", "bias")

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.zeros(64, 64)) for _ in range(3))
        self.bias = nn.Parameter(torch.zeros(64))

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((coeffs[n] * getattr(self, n)).sum() for n in self.order)


def _coefficients(rank: int, model: nn.Module) -> dict[str, torch.Tensor]:
    """Ranks' gradients that nearly cancel: (-1)^rank A + small noise. The first stage then
    quantizes large values, the second their small average: its error dominates."""
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        common = torch.randn(p.shape, generator=torch.Generator().manual_seed(60 + i))
        noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(70 + 10 * i + rank))
        out[name] = (-1) ** rank * common + 0.05 * noise
    return out


def _state(kind: str, error_feedback: bool) -> tuple[object, object]:
    if kind == "cgx":
        params = {"bits": BITS, "bucket_size": BUCKET}
        return CGXState(None, 1024, params, error_feedback=error_feedback, start_iter=0), cgx_hook
    if kind == "sd4":  # packed 4-bit levels: 3 a side for 2 ranks
        return GlobalQSGDState(None, error_feedback=error_feedback), standard_dithering_4bit_hook
    return GlobalQSGDState(None, 3, error_feedback=error_feedback), standard_dithering_hook


def _residual(state: object, p: torch.Tensor) -> torch.Tensor:
    r = state.errors.residual(state.errors.key(p)) if state.errors is not None else None
    return torch.zeros(p.numel()) if r is None else r.clone()


def _constant_gradient(kind: str, error_feedback: bool, steps: int) -> dict:
    """``steps`` backward passes of :class:`Permuted` under DDP with rebuilt buckets."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cgx2.manual_seed(3)
    module = Permuted()
    names = {id(p): n for n, p in module.named_parameters()}
    model = DDP(module, bucket_cap_mb=0.02)
    state, hook = _state(kind, error_feedback)
    layouts: list[list[tuple[str, ...]]] = []

    def recording_hook(s: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        layouts[-1].append(tuple(names[id(p)] for p in bucket.parameters()))
        return hook(s, bucket)

    model.register_comm_hook(state, recording_hook)
    coeffs = _coefficients(rank, module)
    params = dict(module.named_parameters())
    before = {n: torch.zeros(p.numel()) for n, p in params.items()}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    records = []
    for _ in range(steps):
        layouts.append([])
        model.zero_grad(set_to_none=True)
        model(coeffs).backward()
        after = {n: _residual(state, p) for n, p in params.items()}
        records.append(
            {
                n: {
                    "grad": p.grad.clone(),
                    "residual": after[n],
                    "contribution": coeffs[n].reshape(-1) + before[n] - after[n],
                }
                for n, p in params.items()
            }
        )
        for n, p in params.items():
            total[n] += p.grad
        before = after
    truth = {n: sum(_coefficients(r, module)[n] for r in range(world)) / world for n in params}
    error = sum((total[n] / steps - truth[n]).square().sum() for n in params) ** 0.5
    return {
        "layouts": layouts,
        "records": records,
        "error": error.item(),
        "norm": sum(t.square().sum() for t in truth.values()).item() ** 0.5,
    }


class Chain(nn.Module):
    """An MLP registered in the order its gradients become ready, so that DDP's rebuilt
    bucket is its first one: the quantization of a resumed run's first step is the same."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))
        self.w2 = nn.Parameter(torch.randn(64, 4) / 8)
        self.w1 = nn.Parameter(torch.randn(64, 64) / 8)
        self.w0 = nn.Parameter(torch.randn(32, 64) / 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ self.w0) @ self.w1) @ self.w2 + self.bias


def _resume(kind: str, split: int | None, steps: int, keep_residuals: bool = True) -> dict:
    """Train ``steps`` steps with error feedback; with ``split``, checkpoint there and go on
    with a fresh model, optimizer and state loaded from it (residuals dropped unless
    ``keep_residuals``)."""
    rank = dist.get_rank()
    layouts: list[tuple[int, ...]] = []

    def fresh() -> tuple[DDP, torch.optim.Optimizer, object]:
        torch.manual_seed(0)
        model = DDP(Chain())
        state, hook = _state(kind, True)

        def recording_hook(
            s: object, bucket: dist.GradBucket
        ) -> torch.futures.Future[torch.Tensor]:
            layouts.append(tuple(p.numel() for p in bucket.parameters()))
            return hook(s, bucket)

        model.register_comm_hook(state, recording_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), state

    cgx2.manual_seed(4)
    model, opt, state = fresh()
    saved_residuals = 0
    for step in range(steps):
        if step == split:
            buffer = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
                buffer,
            )
            cgx2.manual_seed(999)  # whatever happens in between
            model, opt, state = fresh()
            buffer.seek(0)
            checkpoint = torch.load(buffer, weights_only=True)
            saved_residuals = len(checkpoint["hook"]["error_feedback"]["residuals"])
            if not keep_residuals:
                checkpoint["hook"]["error_feedback"] = None
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["opt"])
            state.load_state_dict(checkpoint["hook"])
        g = torch.Generator().manual_seed(10 * (step % 3) + rank)
        x = torch.randn(32, 32, generator=g)
        opt.zero_grad()
        loss = (model(x) - x[:, :4]).square().mean()
        loss.backward()
        opt.step()
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"params": params, "layouts": layouts, "saved_residuals": saved_residuals}


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collective_error_is_exactly_what_the_owners_decode(dist2, dtype):
    for r in dist2.run(_collective_error, dtype):
        assert r["same"] and r["pieces"] >= 2
        assert torch.equal(r["error"], (r["x"].float() - r["decoded"]).to(dtype))
        # sent (as decoded) + residual == input, up to the rounding of one subtraction
        rebuilt = r["decoded"] + r["error"].float()
        atol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16 rounds the residual
        assert torch.allclose(rebuilt, r["x"].float(), rtol=0, atol=atol)
        assert (r["error"] == 0).float().mean() > 0.3  # the own chunk, kept exact


@pytest.mark.parametrize("name", ["standard_dithering", "thc", "qsgd", "exponential_dithering"])
def test_global_qsgd_residual_is_input_minus_own_contribution(dist2, name):
    for out, expected in dist2.run(_gq_algebra, name):
        assert torch.allclose(out, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["cgx", "sd", "sd4"])
def test_error_feedback_through_ddp_rebuild_shrinks_the_mean_error(dist2, kind):
    """Constant gradients for 24 steps: with error feedback the mean of the averaged
    gradients reaches the true average faster (the residuals telescope); the residual
    algebra holds per parameter in every step, across DDP's bucket rebuild; replicas agree."""
    steps = 24
    with_ef = dist2.run(_constant_gradient, kind, True, steps)
    without = dist2.run(_constant_gradient, kind, False, steps)
    layouts = with_ef[0]["layouts"]
    assert layouts[0] != layouts[1] and layouts[1] == layouts[-1]  # rebuilt after step one
    for run in (with_ef, without):
        for a, b in zip(run[0]["records"], run[1]["records"], strict=True):
            assert all(torch.equal(a[n]["grad"], b[n]["grad"]) for n in a)
    ours, theirs = with_ef[0]["error"], without[0]["error"]
    assert ours < 0.5 * theirs, (ours, theirs)
    # Per parameter and step: the ranks' contributions (input + old residual - new residual)
    # average to the result: exactly for Global-QSGD; for CGX within the second stage's
    # quantization step, which is far below the residuals a mix-up would move.
    world, levels = 2, 2**BITS - 1
    for t, (a, b) in enumerate(zip(with_ef[0]["records"], with_ef[1]["records"], strict=True)):
        for n in a:
            grad = a[n]["grad"].reshape(-1)
            mean = (a[n]["contribution"] + b[n]["contribution"]) / world
            gap = (grad - mean).abs().max().item()
            if kind != "cgx" or n == "bias":
                assert gap < 1e-5, (t, n, gap)
            else:  # |Q(s) - s| < step <= range(Q(s)) / (levels - 2) over each bucket
                bound = (grad.max() - grad.min()).item() / (levels - 2)
                assert gap <= bound + 1e-6, (t, n, gap, bound)
                # A rank's residual is zero on the chunk it owns: look at both ranks'.
                largest = max(a[n]["residual"].abs().max(), b[n]["residual"].abs().max())
                assert largest > 3 * bound  # a mix-up of residuals would show


@pytest.mark.parametrize("kind", ["cgx", "sd"])
def test_checkpoint_resumes_identically_only_with_the_residuals(dist2, kind):
    straight = dist2.run(_resume, kind, None, 6)
    resumed = dist2.run(_resume, kind, 3, 6)
    dropped = dist2.run(_resume, kind, 3, 6, False)
    assert len(set(straight[0]["layouts"])) == 1  # one bucket layout: resuming cannot change it
    assert resumed[0]["saved_residuals"] > 0
    for s, r, d in zip(straight, resumed, dropped, strict=True):
        for name, p in s["params"].items():
            assert torch.equal(p, r["params"][name]), name
        diff = max((p - d["params"][n]).abs().max().item() for n, p in s["params"].items())
        assert diff > 0  # the residuals matter: without them the run goes elsewhere


def _non_finite_step(kind: str) -> list[bool]:
    """Three steps with error feedback; rank 0's gradient is inf at the first."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(64, 32))
    state, hook = _state(kind, True)
    model.register_comm_hook(state, hook)
    finite = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss = model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step))).sum()
        if step == 0 and dist.get_rank() == 0:
            loss = loss * float("inf")
        loss.backward()
        finite.append(all(bool(p.grad.isfinite().all()) for p in model.parameters()))
    return finite


@pytest.mark.parametrize("kind", ["cgx", "sd"])
def test_a_non_finite_step_does_not_poison_the_residuals(dist2, kind):
    """fp16 training with a GradScaler expects an overflowing step now and then and skips it:
    its inf must not stay in the residuals and ruin every later step."""
    for finite in dist2.run(_non_finite_step, kind):
        assert finite == [False, True, True]


def test_residuals_loaded_into_another_model_are_refused():
    saved = ErrorFeedback()
    key = saved.key(torch.zeros(4, 8))
    saved.store_(key, torch.ones(32))
    fresh = ErrorFeedback()
    fresh.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match=r"shape \(4, 8\).*shape \(8, 4\)"):
        fresh.key(torch.zeros(8, 4))
    fresh = ErrorFeedback()
    fresh.load_state_dict(saved.state_dict())
    assert fresh.key(torch.zeros(4, 8)) == key  # the same model built the same way
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict({"residuals": {key: torch.ones(32)}, "shapes": {key: [2, 16]}})


def _with_options(options: dict, env: dict) -> dict:
    """Five steps of :class:`Permuted` with error feedback and ``options`` (adaptive widths,
    or CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS through ``env``)."""
    import os

    os.environ.update(env)
    try:
        cgx2.manual_seed(5)
        module = Permuted()
        model = DDP(module, bucket_cap_mb=0.02)
        params = {"bits": BITS, "bucket_size": 48}  # 64x64 layers end in a partial bucket
        state = CGXState(None, 1024, params, error_feedback=True, start_iter=0, **options)
        model.register_comm_hook(state, cgx_hook)
        coeffs = _coefficients(dist.get_rank(), module)
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            model(coeffs).backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        kept = {n: _residual(state, p) for n, p in module.named_parameters() if p.dim() > 1}
        return {"grads": grads, "kept": kept, "plans": dict(state._bit_plans)}
    finally:
        for k in env:
            del os.environ[k]


@pytest.mark.parametrize(
    ("options", "env"),
    [
        ({"adaptive_bits": (2, 4, 8), "replan_every": 2}, {}),
        ({}, {"CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS": "1"}),
    ],
)
def test_error_feedback_with_adaptive_widths_or_raw_tails(dist2, options, env):
    """Error feedback combines with adaptive widths and with layers whose last bucket goes
    raw: replicas agree, and every compressed layer keeps a nonzero residual on a rank (zero
    on the one that owns it: its own chunk stays exact)."""
    a, b = dist2.run(_with_options, options, env)
    assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
    assert len(a["kept"]) == 3
    for n in a["kept"]:
        assert max(float(a["kept"][n].abs().max()), float(b["kept"][n].abs().max())) > 0, n
    assert bool(a["plans"]) == ("adaptive_bits" in options)


def _load_the_other_ranks_residuals() -> str:
    state = ErrorFeedback().state_dict()
    assert state["rank"] == dist.get_rank()
    state["rank"] = 1 - dist.get_rank()  # as if every rank loaded rank 0's file
    try:
        ErrorFeedback().load_state_dict(state)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_residuals_are_refused_on_another_rank(dist2):
    """Residuals differ from rank to rank: resuming every rank from one rank's file would
    quietly feed the wrong errors back, so loading them on another rank is an error."""
    for rank, message in enumerate(dist2.run(_load_the_other_ranks_residuals)):
        assert f"rank {1 - rank}'s, loaded on rank {rank}" in message
