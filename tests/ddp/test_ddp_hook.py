"""CGX's DDP hook on gloo: large layers compressed, small ones exact, gradients identical on
every rank, training close to uncompressed DDP; CGXState's arguments and errors."""

import os
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx2 import config, seeding
from cgx2.comm import worker
from cgx2.ddp import CGXState, cgx_hook


class Net(nn.Module):
    """Conv (216 weights: exact), Linear 288->64 (18432: compressed), LayerNorm, Linear 64->4."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc1 = nn.Linear(8 * 6 * 6, 64)
        self.norm = nn.LayerNorm(64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.norm(self.fc1(h))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 3, 8, 8, generator=g)
    return x, (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()


def _train(
    bits: int | None, steps: int, params: dict | None = None, error_feedback: bool = False
) -> dict:
    """Train Net under DDP (several buckets) with cgx_hook at ``bits`` (None: DDP's own)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.02)
    if bits is not None:
        state = CGXState(
            None,
            1024,
            {"bits": bits, "bucket_size": 128, **(params or {})},
            start_iter=0,
            error_feedback=error_feedback,
        )
        model.register_comm_hook(state, cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    losses, first_grads = [], None
    for step in range(steps):
        x, y = _batch(rank, step % 4)  # a small fixed set: the loss must fall
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        opt.step()
        losses.append(loss.item())
    params_now = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "grads": first_grads, "params": params_now}


def _average_loss(results: list[dict], last: int) -> float:
    return sum(sum(r["losses"][-last:]) / last for r in results) / len(results)


def test_gradients_identical_on_ranks_small_layers_exact(dist2):
    compressed = dist2.run(_train, 4, 1)
    plain = dist2.run(_train, None, 1)
    for name, grad in compressed[0]["grads"].items():
        assert torch.equal(grad, compressed[1]["grads"][name]), name
        reference = plain[0]["grads"][name]
        if name == "fc1.weight":  # the only layer with dim > 1 and >= 1024 values
            rel = ((grad - reference).norm() / reference.norm()).item()
            assert 0 < rel < 0.2, rel
        else:
            assert torch.equal(grad, reference), name


def _train_with_worker(on: bool) -> dict:
    seeding.manual_seed(0)  # the pool's processes have drawn seeds for earlier tests
    counted = mock.patch.object(worker, "submit", wraps=worker.submit)
    with config.tuned(comm_worker=on), counted as submit:
        result = _train(4, 3, error_feedback=True)
    result["submitted"] = submit.call_count
    return result


def test_the_worker_thread_gives_the_same_bits_as_autograds(dist2):
    """On gloo the hook's collectives run on the group's worker thread (the backward pass goes
    on meanwhile); the buckets reduce in the same order, so training is bit for bit what it is
    with CGX2_COMM_WORKER=0, error feedback's residuals included."""
    on, off = dist2.run(_train_with_worker, True), dist2.run(_train_with_worker, False)
    assert on[0]["submitted"] > 3 and off[0]["submitted"] == 0  # 3 steps, buckets each
    for rank in range(2):
        assert on[rank]["losses"] == off[rank]["losses"]
        for name, p in on[rank]["params"].items():
            assert torch.equal(p, off[rank]["params"][name]), name


def _train_exact_over_the_process_group(worker_on: bool) -> dict:
    from cgx2.comm import process_group

    counted = mock.patch.object(
        process_group, "allreduce_plain_async_", wraps=process_group.allreduce_plain_async_
    )
    with (
        config.tuned(comm_worker=worker_on, transport="process_group", crossover_bytes=1 << 40),
        counted as started,
    ):
        result = _train(4, 3)
    result["started"] = started.call_count
    return result


def test_buckets_sent_exact_are_left_running_and_give_ddps_own_bits(dist2):
    """Where every bucket goes exact over gloo (below the crossover), the worker leaves each
    allreduce running, as DDP's own does, and goes on to the next bucket: the training is bit
    for bit DDP's and the hook's run inline (each divides before the sum)."""
    running = dist2.run(_train_exact_over_the_process_group, True)
    inline = dist2.run(_train_exact_over_the_process_group, False)
    ddp = dist2.run(_train, None, 3)
    assert running[0]["started"] > 3 and inline[0]["started"] == 0
    for rank in range(2):
        assert running[rank]["losses"] == inline[rank]["losses"] == ddp[rank]["losses"]
        for name, p in running[rank]["params"].items():
            assert torch.equal(p, inline[rank]["params"][name]), name
            assert torch.equal(p, ddp[rank]["params"][name]), name


def _train_layers(coalesce: bool, steps: int = 3) -> dict:
    """Four Linear(64, 64) under DDP in small buckets (weights compressed, biases exact), the
    hook inline (no worker), the exact layers coalesced into the last bucket or not."""
    from cgx2.collectives import policy
    from cgx2.comm import process_group

    rank = dist.get_rank()
    on_gloo = policy.coalesces_exact(torch.zeros(1), dist.group.WORLD)  # before the patch
    seeding.manual_seed(0)  # the pool's processes have drawn seeds for earlier tests
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))), bucket_cap_mb=0.017)
    model.register_comm_hook(CGXState(None, 1024, {"bits": 4}, start_iter=0), cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counted = mock.patch.object(
        process_group, "allreduce_plain_", wraps=process_group.allreduce_plain_
    )
    with (
        config.tuned(comm_worker=False, transport="process_group", crossover_bytes=0),
        mock.patch.object(policy, "coalesces_exact", lambda t, group: coalesce),
        counted as plain,
    ):
        calls = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 64, generator=g)
            opt.zero_grad()
            before = plain.call_count
            model(x).square().mean().backward()
            calls.append(plain.call_count - before)
            opt.step()
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"calls": calls, "params": params, "on_gloo": on_gloo}


def test_exact_layers_wait_for_the_last_bucket_in_one_allreduce(dist2):
    """Where the hook runs inline (CUDA on NCCL), the exact layers of every compressed bucket
    are averaged together in one plain allreduce at the backward pass's last bucket, each
    bucket's future set only then: the same bits as an allreduce a bucket (two ranks sum
    alike in any grouping), identical on both ranks."""
    coalesced = dist2.run(_train_layers, True)
    per_bucket = dist2.run(_train_layers, False)
    # After DDP's first pass (one bucket) it rebuilds them small: an allreduce a bucket.
    assert min(per_bucket[0]["calls"][1:]) >= 2 and coalesced[0]["calls"] == [1, 1, 1]
    assert coalesced[0]["on_gloo"] is False  # gloo keeps an allreduce a bucket
    for name, p in coalesced[0]["params"].items():
        assert torch.equal(p, coalesced[1]["params"][name]), name
        assert torch.equal(p, per_bucket[0]["params"][name]), name


def _backward_raising_in_the_hook() -> str:
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.02)
    model.register_comm_hook(CGXState(None, 1024, {"bits": 4}, start_iter=0), cgx_hook)

    def fail(*args):
        raise ValueError("the bucket could not be reduced")

    x, y = _batch(dist.get_rank(), 0)
    with mock.patch.object(sys.modules["cgx2.ddp.cgx_hook"], "_reduce_bucket_", fail):
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        except Exception as e:  # DDP's reducer wraps it
            return str(e)
    return "no error"


def test_an_error_on_the_worker_raises_in_backward(dist2):
    for message in dist2.run(_backward_raising_in_the_hook):
        assert "ValueError: the bucket could not be reduced" in message, message
        assert "Unable to cast" not in message  # not read as a value of the wrong type


def test_eight_bits_is_close_and_thirty_two_is_exact(dist2):
    eight = dist2.run(_train, 8, 1)[0]["grads"]["fc1.weight"]
    full = dist2.run(_train, 32, 1)[0]["grads"]
    plain = dist2.run(_train, None, 1)[0]["grads"]
    assert ((eight - plain["fc1.weight"]).norm() / plain["fc1.weight"].norm()).item() < 0.01
    assert all(torch.equal(full[n], plain[n]) for n in plain)


def _train_skipping_incomplete(bits: int) -> dict:
    os.environ["CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS"] = "1"
    try:
        return _train(bits, 1, {"bucket_size": 1000})
    finally:
        del os.environ["CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS"]


def test_skip_incomplete_buckets_sends_layer_tails_exact(dist2):
    """fc1.weight has 18432 values: with buckets of 1000 its last 432 go uncompressed."""
    results = dist2.run(_train_skipping_incomplete, 4)
    plain = dist2.run(_train, None, 1)[0]["grads"]["fc1.weight"].view(-1)
    grad = results[0]["grads"]["fc1.weight"].view(-1)
    assert torch.equal(grad, results[1]["grads"]["fc1.weight"].view(-1))
    assert torch.equal(grad[-432:], plain[-432:])
    assert not torch.equal(grad[-433:], plain[-433:])


def test_four_bit_training_tracks_uncompressed(dist2):
    """40 SGD steps: the mean loss of the last 10 steps is within 5% of the starting loss of
    uncompressed DDP's (which falls by more than half)."""
    compressed = dist2.run(_train, 4, 40)
    plain = dist2.run(_train, None, 40)
    for name, p in compressed[0]["params"].items():
        assert torch.equal(p, compressed[1]["params"][name]), f"replicas drifted: {name}"
    start = sum(r["losses"][0] for r in plain) / len(plain)
    ours, theirs = _average_loss(compressed, 10), _average_loss(plain, 10)
    assert theirs < 0.5 * start  # it learns
    assert abs(ours - theirs) <= 0.05 * start, (ours, theirs, start)


def test_compression_params_override_environment(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "3")
    monkeypatch.setenv("CGX_COMPRESSION_BUCKET_SIZE", "256")
    monkeypatch.setenv("CGX_COMPRESSION_MINIMAL_SIZE", "5000")
    from_env = CGXState(None)
    assert (from_env.bits, from_env.bucket_size, from_env.layer_min_size) == (3, 256, 5000)
    explicit = CGXState(None, 10_000, {"bits": 6, "bucket_size": 64})
    assert (explicit.bits, explicit.bucket_size, explicit.layer_min_size) == (6, 64, 10_000)


def test_defaults_are_cgx_defaults(monkeypatch):
    for var in ("CGX_COMPRESSION_QUANTIZATION_BITS", "CGX_COMPRESSION_BUCKET_SIZE"):
        monkeypatch.delenv(var, raising=False)
    state = CGXState(dist.group.WORLD)
    assert (state.bits, state.bucket_size, state.layer_min_size) == (32, 512, 1024)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"compression_params": {"bits": 9}}, ValueError, r"compression_params\['bits'\]"),
        ({"compression_params": {"bits": 0}}, ValueError, r"compression_params\['bits'\]"),
        ({"compression_params": {"bucket_size": 0}}, ValueError, "bucket_size"),
        ({"compression_params": {"bits": "4"}}, TypeError, "bits"),
        ({"compression_params": {"quantization_bits": 4}}, ValueError, "unknown keys"),
        ({"layer_min_size": -1}, ValueError, "layer_min_size"),
    ],
)
def test_bad_state_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        CGXState(None, **kwargs)


def test_hook_needs_a_cgx_state():
    with pytest.raises(TypeError, match="CGXState"):
        cgx_hook(None, None)


def test_hook_outside_ddp_is_refused_clearly():
    """FSDP's register_comm_hook calls hook(state, grad): not a DDP GradBucket."""
    with pytest.raises(TypeError, match=r"DistributedDataParallel communication hook.*Tensor"):
        cgx_hook(CGXState(None), torch.zeros(4))


def test_cgx_utils_drop_in():
    import cgx_utils

    assert cgx_utils.CGXState is CGXState and cgx_utils.cgx_hook is cgx_hook


def _bytes(bits: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.02)
    state = CGXState(None, 1024, {"bits": bits, "bucket_size": 128}, start_iter=0)
    model.register_comm_hook(state, cgx_hook)
    x, y = _batch(dist.get_rank(), 0)
    nn.functional.cross_entropy(model(x), y).backward()
    return state.bytes_sent, state.bytes_uncompressed


def test_bytes_sent_are_counted(dist2):
    (sent4, plain4), _ = dist2.run(_bytes, 4)
    (sent32, plain32), _ = dist2.run(_bytes, 32)
    numel = sum(p.numel() for p in Net().parameters())
    assert plain4 == plain32 == numel * 4  # ring allreduce of fp32, W = 2: 2(W-1)/W = 1
    assert sent32 == plain32
    # fc1.weight (18432 of the values) at 4 bits, bucket 128: 64 + 8 bytes per 128 values.
    fc1 = 18432
    assert sent4 == (numel - fc1) * 4 + 2 * (fc1 // 2 // 128) * (64 + 8)


class Deep(nn.Module):
    """Four 64x64 layers, each compressed: DDP's first iteration puts all in one bucket, its
    rebuilt buckets (``bucket_cap_mb=0.02``) hold one each, in the order backward meets them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _resume(
    split: int | None,
    steps: int,
    model_name: str = "net",
    error_feedback: bool = False,
    comm_worker: bool = True,
    find_unused: bool = False,
) -> dict:
    """Train ``steps`` steps; with ``split``, checkpoint after ``split`` steps (torch.save of
    model, optimizer and hook state) and go on with a fresh model, optimizer and CGXState
    loaded from the checkpoint. Returns the losses, the final parameters and what cgx2
    logged as warnings."""
    with config.tuned(comm_worker=comm_worker):
        return _resume_run(split, steps, model_name, error_feedback, find_unused)


def _resume_run(
    split: int | None, steps: int, model_name: str, error_feedback: bool, find_unused: bool
) -> dict:
    import io
    import logging

    import cgx2

    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("cgx2").addHandler(handler)

    groups = []

    def fresh(
        group: dist.ProcessGroup | None = None,
    ) -> tuple[DDP, torch.optim.Optimizer, CGXState]:
        torch.manual_seed(0)
        model = DDP(
            Net() if model_name == "net" else Deep(),
            bucket_cap_mb=0.02,
            process_group=group,
            find_unused_parameters=find_unused,
        )
        state = CGXState(
            group,
            1024,
            {"bits": 3, "bucket_size": 128},
            start_iter=0,
            error_feedback=error_feedback,
        )
        model.register_comm_hook(state, cgx_hook)
        return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5), state

    cgx2.manual_seed(4)
    model, opt, state = fresh()
    losses = []
    for step in range(steps):
        if step == split:
            buffer = io.BytesIO()
            try:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "hook": state.state_dict(),
                    },
                    buffer,
                )
            finally:
                logging.getLogger("cgx2").removeHandler(handler)
            cgx2.manual_seed(999)  # whatever happens in between
            # A fresh group too: its transports, worker and counters start anew.
            groups.append(dist.new_group())
            model, opt, state = fresh(groups[-1])
            buffer.seek(0)
            checkpoint = torch.load(buffer, weights_only=True)
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["opt"])
            state.load_state_dict(checkpoint["hook"])
        if model_name == "net":
            x, y = _batch(dist.get_rank(), step % 4)
            loss = nn.functional.cross_entropy(model(x), y)
        else:
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            x = torch.randn(32, 64, generator=g)
            loss = (model(x) - x.roll(1, 1)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    logging.getLogger("cgx2").removeHandler(handler)
    for group in groups:
        dist.destroy_process_group(group)
    params = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return {"losses": losses, "params": params, "warned": warned}


def test_checkpointed_hook_state_resumes_identically(dist2):
    straight = dist2.run(_resume, None, 6)
    resumed = dist2.run(_resume, 3, 6)
    assert [r["losses"] for r in straight] == [r["losses"] for r in resumed]


@pytest.mark.parametrize("error_feedback", [False, True])
def test_resume_into_a_fresh_ddp_is_bit_identical(dist2, error_feedback):
    """A fresh DDP's first iteration puts every parameter in one bucket, the run it resumes
    had rebuilt its buckets: the hook quantizes the layers as the checkpointed run grouped
    them, so the parameters come out bit for bit those of a run never interrupted."""
    straight = dist2.run(_resume, None, 5, "deep", error_feedback)
    for split, comm_worker in ((2, True), (4, True), (2, False)):
        resumed = dist2.run(_resume, split, 5, "deep", error_feedback, comm_worker)
        for s, r in zip(straight, resumed, strict=True):
            assert s["losses"] == r["losses"], split
            for name, p in s["params"].items():
                assert torch.equal(p, r["params"][name]), (split, name)
            assert not r["warned"]


def test_a_checkpoint_before_ddps_rebuild_says_it_does_not_resume_bit_identically(dist2):
    """After DDP's first pass only, the buckets the next step uses are not known yet (DDP
    rebuilds them at that step): saving warns, and a resumed run stays close."""
    straight = dist2.run(_resume, None, 3, "deep")
    resumed = dist2.run(_resume, 1, 3, "deep")
    for s, r in zip(straight, resumed, strict=True):
        assert any("before DDP rebuilt its buckets" in w for w in r["warned"]), r["warned"]
        for name, p in s["params"].items():
            assert torch.allclose(p, r["params"][name], atol=1e-2), name
    # With find_unused_parameters DDP lays its buckets out by size and never rebuilds them.
    straight = dist2.run(_resume, None, 3, "deep", True, True, True)
    resumed = dist2.run(_resume, 1, 3, "deep", True, True, True)
    for s, r in zip(straight, resumed, strict=True):
        assert not r["warned"]
        for name, p in s["params"].items():
            assert torch.equal(p, r["params"][name]), name


def _load_into_another_model() -> str:
    """Deep's hook checkpoint (after DDP rebuilt its buckets) loaded for Net's DDP."""
    torch.manual_seed(0)
    model = DDP(Deep(), bucket_cap_mb=0.02)
    state = CGXState(None, 1024, {"bits": 4, "bucket_size": 128}, start_iter=0)
    model.register_comm_hook(state, cgx_hook)
    for _ in range(2):
        model(torch.randn(4, 64)).sum().backward()
    saved = state.state_dict()
    other = DDP(Net())
    state = CGXState(None, 1024, {"bits": 4, "bucket_size": 128}, start_iter=0)
    state.load_state_dict(saved)
    other.register_comm_hook(state, cgx_hook)
    x, y = _batch(dist.get_rank(), 0)
    try:
        nn.functional.cross_entropy(other(x), y).backward()
    except Exception as e:  # DDP may wrap what the hook raised
        return str(e)
    return "no error"


def test_a_checkpoint_loaded_into_another_model_is_refused(dist2):
    for message in dist2.run(_load_into_another_model):
        assert "the checkpoint's buckets do not hold the parameter of shape" in message
    state = CGXState(None, 1024, {"bits": 4})
    saved = state.state_dict()
    for layout, error in [
        ("x", TypeError),
        ([[0, [1, 2], [[3], [3]]], [1, [2], [[3]]]], ValueError),
    ]:
        with pytest.raises(error, match="'layout'"):
            state.load_state_dict({**saved, "layout": layout})


def _first_iterations(start_iter: int) -> list[tuple[int, int]]:
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.02)
    state = CGXState(None, 1024, {"bits": 4, "bucket_size": 128}, start_iter=start_iter)
    model.register_comm_hook(state, cgx_hook)
    sent = []
    for step in range(3):
        x, y = _batch(dist.get_rank(), step)
        before = state.bytes_sent, state.bytes_uncompressed
        nn.functional.cross_entropy(model(x), y).backward()
        sent.append((state.bytes_sent - before[0], state.bytes_uncompressed - before[1]))
    assert state.iteration == 3 and state.state_dict()["iteration"] == 3
    return sent


def test_first_iteration_goes_exact_by_default(dist2):
    """DDP's first iteration (the whole model in one bucket) is averaged exactly, as CGX did;
    compression starts at the second; start_iter=0 compresses from the first."""
    default, _ = dist2.run(_first_iterations, 1)
    (first, plain), later = default[0], default[1:]
    assert first == plain
    assert all(sent < plain for sent, plain in later)
    eager, _ = dist2.run(_first_iterations, 0)
    assert all(sent < plain for sent, plain in eager)
    with pytest.raises(ValueError, match="start_iter"):
        CGXState(None, start_iter=-1)
