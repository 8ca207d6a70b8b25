"""``cgx2.ddp.compress``: CGX's hook registered only where the policy compresses one of the
buckets DDP will reduce, else DDP's own allreduce; the decision logged, alike on every rank."""

import itertools
import logging
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx2 import config, seeding
from cgx2.collectives import policy
from cgx2.ddp import CGXState, cgx_hook, compress


class Mlp(nn.Module):
    """256 -> 768 -> 256, then six 256 x 256 layers (all compressed) with biases and a norm
    (exact): 3 MiB of fp32, more than DDP's 1 MiB first bucket, and uneven, so that buckets
    filled from the last layer hold other layers than buckets filled from the first."""

    def __init__(self) -> None:
        super().__init__()
        widths = [256, 768] + [256] * 7
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.norm = nn.LayerNorm(256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(
        16, 256, generator=torch.Generator().manual_seed(10 * step + dist.get_rank())
    )


def _step(model: DDP, opt: torch.optim.Optimizer | None, step: int) -> float:
    x = _batch(step)
    loss = (model(x) - x.roll(1, 1)).square().mean()
    if opt is not None:
        opt.zero_grad()
    loss.backward()
    if opt is not None:
        opt.step()
    return loss.item()


class _Said(logging.Handler):
    """The records of cgx2's logger, from INFO on, while installed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "_Said":
        logger = logging.getLogger("cgx2")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("cgx2")
        logger.removeHandler(self)
        logger.setLevel(self._level)


def _bucket_sizes(ddp_kwargs: dict) -> tuple[list[int], list[int]]:
    """What compress asked the policy about, against what the hook asks about the buckets DDP
    hands it once it has rebuilt them (the second backward pass): the values to quantize of
    each bucket, as asked by the two entry points themselves (not the collectives they call)."""
    asked: list[int] = []
    ask = policy.compresses

    def spy(*args: object) -> bool:
        if sys._getframe(1).f_code.co_name in ("_compresses", "_reduce_bucket_"):
            asked.append(args[4])
        return ask(*args)

    with config.tuned(crossover_bytes=0), mock.patch.object(policy, "compresses", spy):
        torch.manual_seed(0)
        compress(DDP(Mlp(), **ddp_kwargs), bits=4, bucket_size=128, layer_min_size=1024)
        decided = sorted(asked)
        torch.manual_seed(0)
        model = DDP(Mlp(), **ddp_kwargs)
        state = CGXState(None, 1024, {"bits": 4, "bucket_size": 128}, start_iter=0)
        model.register_comm_hook(state, cgx_hook)
        _step(model, None, 0)
        asked.clear()
        _step(model, None, 1)
        hooked = sorted(asked)
    return decided, hooked


@pytest.mark.parametrize(
    "ddp_kwargs",
    [
        {},
        {"bucket_cap_mb": 0.6},
        {"find_unused_parameters": True},
        {"bucket_cap_mb": 0.6, "find_unused_parameters": True},
    ],
    ids=["default-caps", "small-caps", "no-rebuild", "small-caps-no-rebuild"],
)
def test_the_policy_is_asked_about_the_buckets_ddp_will_reduce(dist2, ddp_kwargs):
    """DDP's first bucket is small (1 MiB), the others hold up to bucket_cap_mb, and it rebuilds
    them after the first pass in the order gradients arrived (not with
    find_unused_parameters): compress asks the policy about each bucket's layers to quantize,
    padded as the hook pads them, exactly as the hook asks in the steps that follow."""
    for decided, hooked in dist2.run(_bucket_sizes, ddp_kwargs):
        assert len(hooked) > 1 and decided == hooked


def _train(how: str, crossover: int, steps: int = 3) -> dict:
    """``steps`` SGD steps of Mlp under DDP: plain, with ``compress``, or with cgx_hook
    registered by hand with the state compress would build."""
    seeding.manual_seed(0)  # the pool's processes have drawn seeds for earlier tests
    torch.manual_seed(0)
    with config.tuned(crossover_bytes=crossover), _Said() as said:
        model = DDP(Mlp(), bucket_cap_mb=0.6)
        state = None
        if how == "compress":
            state = compress(
                model,
                bits=4,
                bucket_size=128,
                layer_min_size=1024,
                error_feedback=True,
                start_iter=0,
            )
        elif how == "by hand":
            state = CGXState(
                None, 1024, {"bits": 4, "bucket_size": 128}, error_feedback=True, start_iter=0
            )
            model.register_comm_hook(state, cgx_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        losses = [_step(model, opt, step) for step in range(steps)]
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
        "hook": model._get_ddp_logging_data().get("comm_hook"),
        "state": None
        if state is None
        else (
            type(state).__name__,
            state.bits,
            state.bucket_size,
            state.errors is not None,
            state.start_iter,
        ),
        "bytes_sent": None if state is None else state.bytes_sent,
        "said": [m for m in said.messages if m.startswith("cgx2.ddp.compress")],
    }


def _identical(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), name


def test_above_the_crossover_no_hook_and_ddps_own_bits_logged(dist2):
    """Where no bucket reaches the crossover, compress registers nothing (a hook that sends
    every bucket plain costs DDP's hook machinery for nothing), returns None, and training is
    bit for bit plain DDP's; it says so once, alike on every rank, naming the crossover."""
    kept = dist2.run(_train, "compress", 1 << 40)
    plain = dist2.run(_train, "plain", 1 << 40)
    for rank in range(2):
        assert kept[rank]["hook"] is None and kept[rank]["state"] is None
        _identical(kept[rank], plain[rank])
        (said,) = kept[rank]["said"]
        assert "DDP's own allreduce" in said and str(1 << 40) in said, said
    assert kept[0]["said"] == kept[1]["said"]


def test_below_the_crossover_the_hook_by_hand_bit_for_bit_logged(dist2):
    """Where a bucket reaches the crossover, compress registers cgx_hook with a CGXState of its
    arguments, on DDP's group: training is bit for bit that of the hook registered by hand
    (error feedback included), and it says so once, alike on every rank."""
    compressed = dist2.run(_train, "compress", 0)
    by_hand = dist2.run(_train, "by hand", 0)
    for rank in range(2):
        assert compressed[rank]["hook"] == by_hand[rank]["hook"] == "cgx_hook"
        assert compressed[rank]["state"] == ("CGXState", 4, 128, True, 0)
        assert 0 < compressed[rank]["bytes_sent"] == by_hand[rank]["bytes_sent"]
        _identical(compressed[rank], by_hand[rank])
        (said,) = compressed[rank]["said"]
        assert "registered cgx_hook" in said and "4 bits" in said, said
    assert compressed[0]["said"] == compressed[1]["said"]


def _decided_with_worker(comm_worker: bool) -> str | None:
    """The hook compress registered where a calibration file says compression pays for CPU
    tensors on gloo from 0 bytes when called alone, and never beside the training step."""
    import gc
    import json
    import os
    import tempfile

    descriptor, path = tempfile.mkstemp(suffix=".json")
    with os.fdopen(descriptor, "w") as f:
        json.dump(
            {
                "format": policy.CALIBRATION_FORMAT,
                "crossover_bytes": {"cpu/gloo/fp32": 0},
                "beside_crossover_bytes": {"cpu/gloo/fp32": None},
            },
            f,
        )
    group = dist.new_group()  # its crossovers read afresh, from this file
    try:
        with config.tuned(calibration_file=path, comm_worker=comm_worker):
            torch.manual_seed(0)
            model = DDP(Mlp(), process_group=group)
            compress(model, bits=4)
            hook = model._get_ddp_logging_data().get("comm_hook")
            del model
            gc.collect()  # DDP's reducer goes before its group
    finally:
        dist.destroy_process_group(group)
        os.remove(path)
    return hook


def test_the_policy_is_asked_on_the_thread_the_hook_runs_on(dist2):
    """On gloo the hook reduces its buckets on the group's worker, beside the backward pass,
    where the policy takes the crossovers measured beside the training step: compress asks
    there too (and on the calling thread where CGX2_COMM_WORKER=0 keeps the hook there)."""
    assert dist2.run(_decided_with_worker, True) == [None, None]
    assert dist2.run(_decided_with_worker, False) == ["cgx_hook", "cgx_hook"]


def _decisions() -> dict[str, object]:
    """compress on Mlp with nothing to compress for each of several reasons: its result and
    what it said."""
    found = {}
    for name, kwargs in [("32 bits", {"bits": 32}), ("small layers", {"layer_min_size": 1 << 20})]:
        torch.manual_seed(0)
        with config.tuned(crossover_bytes=0), _Said() as said:
            model = DDP(Mlp())
            state = compress(model, **kwargs)
        found[name] = (state, model._get_ddp_logging_data().get("comm_hook"), said.messages)
    return found


def test_nothing_to_compress_keeps_ddps_allreduce_and_says_why(dist2):
    for found in dist2.run(_decisions):
        state, hook, said = found["32 bits"]
        assert state is None and hook is None and any("bits=32" in m for m in said), said
        state, hook, said = found["small layers"]
        assert state is None and hook is None
        assert any("layer_min_size=1048576" in m for m in said), said


_BAD = [
    ({"bits": 9}, "ValueError", "bits"),
    ({"bits": "4"}, "TypeError", "bits"),
    ({"bucket_size": 0}, "ValueError", "bucket_size"),
    ({"layer_min_size": -1}, "ValueError", "layer_min_size"),
    ({"layer_min_size": 1.5}, "TypeError", "layer_min_size"),
    ({"error_feedback": 1}, "TypeError", "error_feedback"),
    ({"start_iter": -1}, "ValueError", "start_iter"),
    ({"adaptive_bits": (2, 9)}, "ValueError", "adaptive_bits"),
    ({"replan_every": 0}, "ValueError", "replan_every"),
    ({"mesh": "flat"}, "TypeError", "mesh"),
]


def _refusals(bad: list = _BAD) -> list[tuple[str, str, object]]:
    """Each of ``bad``'s arguments passed to compress: the error's type and message, and
    whether a hook was registered."""
    torch.manual_seed(0)
    model = DDP(Mlp())
    found = []
    for kwargs, _, _ in bad:
        try:
            compress(model, **kwargs)
        except Exception as e:  # reported to the test
            found.append((type(e).__name__, str(e), model._get_ddp_logging_data().get("comm_hook")))
        else:
            found.append(("", "", model._get_ddp_logging_data().get("comm_hook")))
    return found


def test_bad_arguments_are_refused_naming_them(dist2):
    for found in dist2.run(_refusals):
        for (kwargs, error, name), (raised, message, hook) in zip(_BAD, found, strict=True):
            assert raised == error and name in message and hook is None, (kwargs, raised, message)


def _disagreeing() -> tuple[str, str, object]:
    torch.manual_seed(0)
    model = DDP(Mlp())
    try:
        compress(model, bits=4 if dist.get_rank() == 0 else 8)
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e), model._get_ddp_logging_data().get("comm_hook")
    return "", "", model._get_ddp_logging_data().get("comm_hook")


def test_ranks_whose_settings_differ_are_refused_before_deciding(dist2):
    """A rank that registered the hook beside one that did not would hang at the first bucket:
    compress compares the ranks' settings first, and every rank raises naming them."""
    for raised, message, hook in dist2.run(_disagreeing):
        assert raised == "DisagreementError" and "bits" in message and hook is None, message


@pytest.mark.parametrize("model", [nn.Linear(2, 2), None, "model"])
def test_a_model_that_is_not_ddp_is_refused(model):
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        compress(model, bits=4)
