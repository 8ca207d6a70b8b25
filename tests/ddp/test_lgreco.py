"""L-GreCo's PowerSGD on gloo: one rank reproduces torch's PowerSGD, the error model against
SVD, plans shared by all ranks, fewer bytes than a uniform rank at its error, DDP training,
a checkpointed run resuming identically, Global-QSGD's names, and clear errors."""

import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx2.ddp import LGreCoState, lgreco_hook
from cgx2.ddp.lgreco import rank_errors

_BASIS = torch.randn(2, 48, generator=torch.Generator().manual_seed(5))


class _Net(nn.Module):
    """The first layer sees inputs in a 2-D subspace: its gradient has rank <= 2, so rank 4
    there is waste. Two 64 x 64 layers exercise torch's grouping by shape."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(48, 64, bias=False)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.head(torch.relu(self.c(h)))


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> tuple[float, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * (step % 8) + dist.get_rank())
    z = torch.randn(64, 2, generator=g)
    y = (z[:, 0] > 0).long() + 2 * (z[:, 1] > 0.3).long()
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(z @ _BASIS), y)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    opt.step()
    return loss.item(), grad


def _make(kind: str, **kw: object) -> tuple[nn.Module, object, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = DDP(_Net())
    if kind == "torch":
        state = torch_powersgd.PowerSGDState(None, 2, start_powerSGD_iter=2)
        model.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    else:
        state = LGreCoState(None, start_powerSGD_iter=2, **kw)
        model.register_comm_hook(state, lgreco_hook)
    return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


# ----------------------------------------------------------------- functions run on every rank


def _train(kind: str, steps: int, kw: dict | None = None) -> dict:
    model, state, opt = _make(kind, **(kw or {}))
    losses, grads = zip(*(_step(model, opt, s) for s in range(steps)), strict=True)
    out = {"losses": list(losses), "grads": list(grads)}
    if kind != "torch":
        out |= {
            "sent": state.bytes_sent,
            "plans": dict(state.layer_ranks),
            "plan_errors": dict(state.plan_errors),
        }
    return out


def _save_and_resume(make, steps: int, more: int, load: bool) -> tuple[list, list, object, object]:
    """``steps`` steps of what ``make()`` builds (a DDP model, its hook's state, an optimizer),
    a checkpoint, ``more`` steps; then fresh ones from the checkpoint (the hook's state only if
    ``load``) run the same ``more`` steps. Their gradients, and the first state and the fresh."""
    model, first, opt = make()
    for s in range(steps):
        _step(model, opt, s)
    buffer = io.BytesIO()
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": first.state_dict()}, buffer
    )
    straight = [_step(model, opt, s)[1] for s in range(steps, steps + more)]
    buffer.seek(0)
    checkpoint = torch.load(buffer)  # weights_only: tensors and plain values only
    model, state, opt = make()
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    if load:
        state.load_state_dict(checkpoint["hook"])
    else:  # compress from the same step: only the plans, P, Q and residuals are lost
        state.iter = checkpoint["hook"]["iter"]
    resumed = [_step(model, opt, s)[1] for s in range(steps, steps + more)]
    return straight, resumed, first, state


def _resume(load: bool) -> dict:
    """7 steps, a checkpoint, 5 more; then a fresh model, optimizer and state from the
    checkpoint (the hook's state only if ``load``) run the same 5 steps."""
    kw = {"matrix_approximation_rank": 4, "replan_every": 3}
    straight, resumed, first, state = _save_and_resume(lambda: _make("lgreco", **kw), 7, 5, load)
    pickled = pickle.loads(pickle.dumps(first))  # torch's pickling path keeps our fields
    return {
        "straight": straight,
        "resumed": resumed,
        "pickled_plans": pickled.layer_ranks,
        "plans": state.layer_ranks,
        "pickled_ranks": pickled.ranks,
    }


# ----------------------------------------------------------------------------------- tests


def test_rank_errors_match_svd():
    gen = torch.Generator().manual_seed(0)
    for shape in ((40, 30), (300, 200)):  # exact singular values, then svd_lowrank
        u, _ = torch.linalg.qr(torch.randn(shape[0], shape[1], generator=gen))
        v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=gen))
        s = torch.logspace(0, -2, shape[1])
        m = u @ torch.diag(s) @ v.T
        errs = rank_errors(m, (1, 2, 4, 8))
        exact = [float((s[r:].double() ** 2).sum()) for r in (1, 2, 4, 8)]
        assert errs.tolist() == pytest.approx(exact, rel=3e-3)
    assert rank_errors(m[:3], (1, 2, 4, 8)).tolist()[2:] == pytest.approx([0, 0], abs=1e-3)
    assert rank_errors(torch.zeros(5, 7), (1, 4)).tolist() == [0.0, 0.0]


def test_one_rank_is_torch_powersgd(dist2):
    """ranks=(2,): no planning, and the same P, Q, residuals and seeds as torch's hook."""
    ours = dist2.run(_train, "lgreco", 8, {"matrix_approximation_rank": 2, "ranks": (2,)})
    theirs = dist2.run(_train, "torch", 8)
    for a, b in zip(ours, theirs, strict=True):
        for ga, gb in zip(a["grads"], b["grads"], strict=True):
            assert torch.equal(ga, gb)


def test_planned_alike_and_fewer_bytes_than_uniform_rank(dist2, dist4):
    """Ranks 1-8 against rank 4 everywhere: the plan (identical on all ranks, though every
    rank's gradients differ) stays within rank 4's error and sends fewer bytes; training
    falls as far, with gradients identical on every rank."""
    uniform_kw = {"matrix_approximation_rank": 4, "ranks": (4,)}
    adaptive_kw = {"matrix_approximation_rank": 4, "replan_every": 5}
    for pool, steps in ((dist4, 8), (dist2, 30)):
        uniform = pool.run(_train, "lgreco", steps, uniform_kw)[0]
        adaptive = pool.run(_train, "lgreco", steps, adaptive_kw)
        first = adaptive[0]
        assert first["plans"] and first["plan_errors"]
        for r in adaptive:
            assert r["plans"] == first["plans"] and r["plan_errors"] == first["plan_errors"]
            for ga, gb in zip(r["grads"], first["grads"], strict=True):
                assert torch.equal(ga, gb)
        for planned, budget in first["plan_errors"].values():
            assert planned <= budget * 1.001  # the DP's rounding: < one step per layer
        assert first["plans"][0] <= 2  # the first layer's gradient has rank 2
        assert max(first["plans"].values()) >= 4
        assert first["sent"] < uniform["sent"]
    # rank 2 instead of 4 on one of three compressed layers, after 2 plain steps
    assert first["sent"] < 0.93 * uniform["sent"], (first["sent"], uniform["sent"])
    late = lambda r: sum(r["losses"][-8:]) / 8
    assert late(first) < 0.6 * first["losses"][0]
    assert late(first) <= 1.05 * late(uniform), (late(first), late(uniform))


def test_checkpoint_resumes_identically(dist2):
    for r in dist2.run(_resume, True):
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b)
        assert r["pickled_plans"] == r["plans"] and r["pickled_ranks"] == (1, 2, 4, 8)
    for r in dist2.run(_resume, False):  # the test can fail: without the hook's state
        assert not torch.equal(r["straight"][0], r["resumed"][0])


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"must include matrix_approximation_rank \(4\)"):
        LGreCoState(None, 4, ranks=(1, 2))
    with pytest.raises(ValueError, match="non-empty"):
        LGreCoState(None, 1, ranks=())
    with pytest.raises(ValueError, match="non-empty"):
        LGreCoState(None, 1, ranks="12")
    with pytest.raises(ValueError, match="positive ints"):
        LGreCoState(None, 1, ranks=(0, 1))
    with pytest.raises(ValueError, match="replan_every"):
        LGreCoState(None, 1, replan_every=0)
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        LGreCoState(None, 0)
    with pytest.raises(ValueError, match="start_powerSGD_iter"):  # torch's own check
        LGreCoState(None, 1, start_powerSGD_iter=1)


def test_gqsgd_drop_in():
    from gqsgd import lgreco_hook as module
    from gqsgd import powerSGD_hook  # noqa: F401  (the seed's import line)

    assert module.powerSGD_hook is lgreco_hook
    state = module.PowerSGDState(None, 4, start_powerSGD_iter=10, adjust_freq=50)
    assert isinstance(state, LGreCoState) and isinstance(state, torch_powersgd.PowerSGDState)
    assert state.ranks == (2, 3, 4, 5, 6, 7, 8) and state.replan_every == 50
    assert module.PowerSGDState(None, 1).ranks == (1, 2)


def _train_powersgd(kind: str, steps: int) -> list[torch.Tensor]:
    """cgx2's PowerSGDState/powerSGD_hook (``kind`` "cgx2"), or torch's state through cgx2's
    hook ("torch-state")."""
    from cgx2.ddp import PowerSGDState, powerSGD_hook

    torch.manual_seed(0)
    model = DDP(_Net())
    state_type = PowerSGDState if kind == "cgx2" else torch_powersgd.PowerSGDState
    state = state_type(None, 2, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads = [_step(model, opt, s)[1] for s in range(steps)]
    if kind == "cgx2":
        assert state.bytes_sent > 0 and state.layer_ranks and set(state.layer_ranks.values()) == {2}
    return grads


def test_cgx2_powersgd_is_torch_powersgd(dist2):
    """cgx2.ddp.PowerSGDState + powerSGD_hook give torch's PowerSGD bit for bit (and torch's
    own state passed to cgx2's hook runs torch's hook)."""
    theirs = dist2.run(_train, "torch", 8)
    for kind in ("cgx2", "torch-state"):
        ours = dist2.run(_train_powersgd, kind, 8)
        for a, b in zip(ours, theirs, strict=True):
            for ga, gb in zip(a, b["grads"], strict=True):
                assert torch.equal(ga, gb), kind


def _resume_powersgd(load: bool) -> dict:
    from cgx2.ddp import PowerSGDState, powerSGD_hook

    def make() -> tuple[nn.Module, PowerSGDState, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = DDP(_Net())
        state = PowerSGDState(None, 2, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    straight, resumed, _, _ = _save_and_resume(make, 5, 4, load)
    return {"straight": straight, "resumed": resumed}


def test_cgx2_powersgd_checkpoint_resumes_identically(dist2):
    """P, Q and residuals are saved and restored: a resumed run continues identically (it
    differs when the hook's state is not loaded, so the test can fail)."""
    for r in dist2.run(_resume_powersgd, True):
        for a, b in zip(r["straight"], r["resumed"], strict=True):
            assert torch.equal(a, b)
    for r in dist2.run(_resume_powersgd, False):
        assert not torch.equal(r["straight"][0], r["resumed"][0])


def test_gqsgd_powersgd_module_is_torchs():
    """Global-QSGD's module keeps torch's PowerSGD, batched variant included."""
    import gqsgd.powerSGD_hook as module

    assert module.PowerSGDState is torch_powersgd.PowerSGDState
    assert module.batched_powerSGD_hook is torch_powersgd.batched_powerSGD_hook
