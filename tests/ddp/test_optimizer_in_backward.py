"""``cgx2.ddp.compress(..., optimizer=...)``: the optimizer steps each bucket's parameters in the
backward pass, as the bucket's averaged gradient arrives, and trains as it does after it."""

import contextlib
import importlib
from unittest import mock

import torch
import torch.distributed as dist
from test_compress import Mlp, _batch, _refusals, _Said  # compress's tests' helpers
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx2 import config, seeding
from cgx2.ddp import CGXState, cgx_hook, compress

# Not AdamW's defaults, so that each is seen to be passed on.
ADAMW = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def _params(model: DDP) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _train(
    how: str,
    crossover: int,
    steps: int = 3,
    optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW,
    kwargs: dict | None = None,
    held: bool = False,
) -> dict:
    """``steps`` steps of Mlp under DDP, ``optimizer`` (AdamW) with ``kwargs`` (ADAMW) stepping
    ``"in backward"`` (compress's ``optimizer=``), or after the backward pass as usual, built
    with the same arguments (its ``foreach`` too, or torch's default), with cgx_hook
    registered by hand with the state compress builds (``"hook, after"``) or with DDP's own
    allreduce (``"plain, after"``). Then one step of two backward passes, the first under
    ``no_sync``. ``held``: the hook inline, its exact layers held for the last bucket, as on
    NCCL."""
    from cgx2.collectives import policy

    kwargs = ADAMW if kwargs is None else kwargs
    seeding.manual_seed(0)  # the pool's processes have drawn seeds for earlier tests
    torch.manual_seed(0)
    model = DDP(Mlp(), bucket_cap_mb=0.6)
    opt = None
    if how != "in backward":
        opt = optimizer(model.parameters(), **kwargs)
    inline = config.tuned(comm_worker=False, transport="process_group") if held else None
    holding = mock.patch.object(policy, "coalesces_exact", lambda t, group: True)
    with (
        config.tuned(crossover_bytes=crossover),
        _Said() as said,
        inline or contextlib.nullcontext(),
        holding if held else contextlib.nullcontext(),
    ):
        if how == "in backward":
            compress(
                model,
                bits=4,
                bucket_size=128,
                layer_min_size=1024,
                start_iter=0,
                optimizer=optimizer,
                optimizer_kwargs=kwargs,
            )
        elif how == "hook, after":
            state = CGXState(None, 1024, {"bits": 4, "bucket_size": 128}, start_iter=0)
            model.register_comm_hook(state, cgx_hook)
        moved_in_backward = []
        for step in range(steps):
            x = _batch(step)
            model.zero_grad(set_to_none=True)
            before = _params(model)
            (model(x) - x.roll(1, 1)).square().mean().backward()
            after = _params(model)
            moved_in_backward.append(sum(not torch.equal(before[n], after[n]) for n in after))
            if opt is not None:
                opt.step()
        params = _params(model)
        # Gradient accumulation: a backward pass under no_sync, then one synchronized.
        x = _batch(steps)
        model.zero_grad(set_to_none=True)
        with model.no_sync():
            (model(x) - x.roll(1, 1)).square().mean().backward()
        stepped_under_no_sync = any(
            not torch.equal(p, params[n]) for n, p in _params(model).items()
        )
        x = _batch(steps + 1)
        (model(x) - x.roll(1, 1)).square().mean().backward()
        if opt is not None:
            opt.step()
    return {
        "params": params,
        "accumulated": _params(model),
        "moved_in_backward": moved_in_backward,
        "stepped_under_no_sync": stepped_under_no_sync,
        "hook": model._get_ddp_logging_data().get("comm_hook"),
        "said": [m for m in said.messages if m.startswith("cgx2.ddp.compress")],
    }


def _identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, p in a.items():
        assert torch.equal(p, b[name]), name


def _as_after(inside: list[dict], after: list[dict], hook: str) -> None:
    """``inside`` (the optimizer in the hook named ``hook``) stepped every parameter in each
    backward pass and none under no_sync, and trained bit for bit as ``after``, identical on
    both ranks."""
    n = len(inside[0]["params"])
    for rank in range(2):
        assert inside[rank]["moved_in_backward"] == [n, n, n]
        assert after[rank]["moved_in_backward"] == [0, 0, 0]
        assert inside[rank]["stepped_under_no_sync"] is False
        assert inside[rank]["hook"] == hook
        _identical(inside[rank]["params"], after[rank]["params"])
        _identical(inside[rank]["accumulated"], after[rank]["accumulated"])
    _identical(inside[0]["params"], inside[1]["params"])


def test_compressed_adamw_in_backward_trains_bit_for_bit_as_after_it(dist2):
    """Where a bucket compresses, AdamW steps every parameter in the backward pass (none is
    left to a step after it; under no_sync none is stepped) and three steps (the first before
    DDP rebuilds its buckets, the others after), then one of gradients accumulated under
    no_sync, leave every parameter bit for bit as cgx_hook with AdamW stepping after the
    backward pass (the same averaged gradients, the same arithmetic: torch's default, here on
    CPU single-tensor), identical on both ranks."""
    inside = dist2.run(_train, "in backward", 0)
    after = dist2.run(_train, "hook, after", 0)
    _as_after(inside, after, "cgx_hook_then_AdamW")
    for rank in range(2):
        (said,) = inside[rank]["said"]
        assert "registered cgx_hook" in said and "AdamW stepping each bucket" in said, said
    initial = dist2.run(_train, "in backward", 0, 0)[0]["params"]
    assert all(not torch.equal(p, initial[name]) for name, p in inside[0]["params"].items())


_OTHERS = [
    (torch.optim.AdamW, {**ADAMW, "foreach": True}),  # multi-tensor, as on CUDA by default
    (torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.1, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "foreach": True}),
]


def test_with_exact_layers_held_adamw_in_backward_trains_bit_for_bit_as_after_it(dist2):
    """As on NCCL, where the hook holds the exact layers for the last bucket and the optimizer
    steps each bucket's compressed layers first and its exact ones later: AdamW (single- and
    multi-tensor) trains bit for bit as after the backward pass, identical on both ranks."""
    for kwargs in (ADAMW, {**ADAMW, "foreach": True}):
        inside = dist2.run(_train, "in backward", 0, 3, torch.optim.AdamW, kwargs, True)
        after = dist2.run(_train, "hook, after", 0, 3, torch.optim.AdamW, kwargs, True)
        _as_after(inside, after, "cgx_hook_then_AdamW")


def test_other_optimizers_and_foreach_in_backward_train_bit_for_bit_as_after_it(dist2):
    """AdamW with multi-tensor arithmetic (``foreach=True``), Adam (amsgrad) and SGD with
    momentum, single- and multi-tensor: each in the hook trains bit for bit as the same
    optimizer with the same arguments stepping after the backward pass."""
    for optimizer, kwargs in _OTHERS:
        inside = dist2.run(_train, "in backward", 0, 3, optimizer, kwargs)
        after = dist2.run(_train, "hook, after", 0, 3, optimizer, kwargs)
        _as_after(inside, after, f"cgx_hook_then_{optimizer.__name__}")


def test_uncompressed_adamw_in_backward_is_around_torchs_allreduce_hook(dist2):
    """Where no bucket compresses, compress keeps DDP's allreduce as torch's allreduce_hook with
    AdamW stepping each bucket (as DDP._register_fused_optim does, a bucket in one call), says
    so, and trains bit for bit as plain DDP with AdamW after the backward pass (with two
    ranks, halving the sum is exact either side of it), identical on both ranks."""
    inside = dist2.run(_train, "in backward", 1 << 40)
    after = dist2.run(_train, "plain, after", 1 << 40)
    _as_after(inside, after, "allreduce_hook_then_AdamW")
    for rank in range(2):
        (said,) = inside[rank]["said"]
        assert "allreduce_hook" in said and "AdamW" in said and str(1 << 40) in said


def _calls_per_bucket(crossover: int, kwargs: dict) -> list[dict]:
    """Per backward pass of three: the parameters of each bucket the hook (cgx_hook, or
    torch's allreduce_hook) was given, those of each call of AdamW's functional arithmetic
    (``torch.optim._functional.adamw``) and the ``foreach`` it was called with."""
    # TorchScript compiles the functional optimizers, F.adamw with them, as they are imported:
    # before F.adamw is patched.
    import torch.distributed.optim
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    compress_module = importlib.import_module("cgx2.ddp.compress")  # the package's is the function

    seeding.manual_seed(0)
    torch.manual_seed(0)
    model = DDP(Mlp(), bucket_cap_mb=0.6)
    passes: list[dict] = []
    adamw = torch.optim._functional.adamw

    def arithmetic(params, *args, **kw):
        passes[-1]["calls"].append(frozenset(map(id, params)))
        passes[-1]["foreach"].add(kw["foreach"])
        return adamw(params, *args, **kw)

    def seen(hook):
        def hook_seen(state, bucket):
            passes[-1]["buckets"].append(frozenset(map(id, bucket.parameters())))
            return hook(state, bucket)

        return hook_seen

    with (
        config.tuned(crossover_bytes=crossover),
        mock.patch.object(torch.optim._functional, "adamw", arithmetic),
        mock.patch.object(compress_module, "cgx_hook", seen(compress_module.cgx_hook)),
        mock.patch.object(default_hooks, "allreduce_hook", seen(default_hooks.allreduce_hook)),
    ):
        compress(model, bits=4, start_iter=0, optimizer=torch.optim.AdamW, optimizer_kwargs=kwargs)
        for step in range(3):
            passes.append({"buckets": [], "calls": [], "foreach": set()})
            x = _batch(step)
            model.zero_grad(set_to_none=True)
            (model(x) - x.roll(1, 1)).square().mean().backward()
    everything = frozenset(map(id, model.parameters()))
    return [
        dict(p, all=p["buckets"] and frozenset().union(*p["buckets"]) == everything) for p in passes
    ]


def test_each_bucket_is_stepped_in_one_call_over_its_parameters(dist2):
    """The optimizer's arithmetic runs once per bucket, over exactly the bucket's parameters
    (not once per parameter), before DDP rebuilds its buckets and after (other buckets then:
    so the bit-for-bit tests above see the state follow each parameter into its new bucket);
    multi-tensor where asked (``foreach=True``), as torch.optim decides otherwise (CPU:
    single-tensor); around cgx_hook and torch's allreduce_hook alike."""
    for crossover in (0, 1 << 40):
        for kwargs, foreach in (({"lr": 0.1}, {False}), ({"lr": 0.1, "foreach": True}, {True})):
            for passes in dist2.run(_calls_per_bucket, crossover, kwargs):
                for p in passes:
                    assert p["all"], p
                    assert sorted(p["calls"], key=sorted) == sorted(p["buckets"], key=sorted)
                    assert p["foreach"] == foreach, p
                # DDP's first pass is one bucket of every parameter, then it rebuilds them.
                assert len(passes[0]["buckets"]) == 1 and len(passes[1]["buckets"]) > 1
                assert passes[1]["buckets"] == passes[2]["buckets"]


_BAD = [
    ({"optimizer": torch.optim.Adagrad}, "ValueError", "torch.optim.AdamW"),
    ({"optimizer": torch.optim.RMSprop, "optimizer_kwargs": {"lr": 1.0}}, "ValueError", "Adam,"),
    ({"optimizer": "AdamW"}, "TypeError", "optimizer class"),
    ({"optimizer_kwargs": {"lr": 1.0}}, "ValueError", "optimizer_kwargs"),
    ({"optimizer": torch.optim.AdamW, "optimizer_kwargs": [1.0]}, "TypeError", "mapping"),
    ({"optimizer": torch.optim.AdamW, "optimizer_kwargs": {"lr": -1.0}}, "ValueError", "rate"),
    (
        {"optimizer": torch.optim.AdamW, "optimizer_kwargs": {"capturable": True}},
        "TypeError",
        "capt",
    ),
]


def test_optimizers_without_a_functional_form_are_refused_naming_those_with_one(dist2):
    """Adagrad and RMSprop have no functional form that keeps its state per parameter: the
    error names those that have; a name in place of a class, arguments without an
    optimizer and arguments the optimizer refuses raise too, on every rank before anything is
    sent or registered."""
    for found in dist2.run(_refusals, _BAD):
        for (kwargs, error, text), (raised, message, hook) in zip(_BAD, found, strict=True):
            assert raised == error and text in message and hook is None, (kwargs, message)


def _disagreeing() -> tuple[str, str]:
    torch.manual_seed(0)
    model = DDP(Mlp())
    lr = 1e-3 if dist.get_rank() == 0 else 1e-2
    try:
        compress(model, bits=4, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": lr})
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e)
    return "", ""


def test_ranks_whose_optimizers_differ_are_refused(dist2):
    """Replicas stepped by different optimizers would drift apart: every rank raises."""
    for raised, message in dist2.run(_disagreeing):
        assert raised == "DisagreementError" and "optimizer" in message, message


def _order_of_steps_and_exact_allreduces() -> list[list[str]]:
    """Per backward pass, the hook's plain allreduces (the exact layers) and the optimizer's
    steps (which parameters: "weights" or "biases") in the order they happen: four
    Linear(64, 64) in small buckets (weights compressed, biases exact), the hook inline, its
    exact layers held for the last bucket as on NCCL."""
    from torch import nn

    from cgx2.collectives import policy
    from cgx2.comm import process_group
    from cgx2.ddp import optimizer_overlap

    seeding.manual_seed(0)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))), bucket_cap_mb=0.017)
    events: list[str] = []
    plain_allreduce = process_group.allreduce_plain_
    bucket_step = optimizer_overlap._BucketSteps.step

    def plain(*args, **kwargs):
        events.append("allreduce")
        return plain_allreduce(*args, **kwargs)

    def step(self, key, params, grads):
        events.extend("weights" if p.dim() == 2 else "biases" for p in params)
        return bucket_step(self, key, params, grads)

    passes = []
    with (
        config.tuned(comm_worker=False, transport="process_group", crossover_bytes=0),
        mock.patch.object(policy, "coalesces_exact", lambda t, group: True),
        mock.patch.object(process_group, "allreduce_plain_", plain),
        mock.patch.object(optimizer_overlap._BucketSteps, "step", step),
    ):
        compress(
            model, bits=4, start_iter=0, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}
        )
        for i in range(3):
            events.clear()
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(i))
            model(x).square().mean().backward()
            passes.append(list(events))
    return passes


def test_with_an_optimizer_in_the_hook_compressed_layers_step_before_the_held_exact_ones(dist2):
    """On NCCL the hook holds the exact layers of compressed buckets for the last bucket, to
    send them in one allreduce; an optimizer stepping in the hook steps each bucket's
    compressed layers as soon as they are averaged, before that allreduce (but the last
    bucket's, averaged in the same call), and only the exact layers after it (else every
    step would wait for the last bucket's bytes)."""
    for passes in dist2.run(_order_of_steps_and_exact_allreduces):
        for events in passes[1:]:  # after DDP's first pass (one bucket) rebuilds them small
            assert events.count("allreduce") == 1, events
            held = events.index("allreduce")
            earlier = events[:held]  # the compressed layers of every bucket but the last
            assert earlier and set(earlier) == {"weights"}, events
            after = events[held + 1 :]  # their exact layers, then the last bucket's layers
            n = len(earlier)
            assert after[:n] == ["biases"] * n, events
            last = after[n:]
            assert last == ["weights"] * (4 - n) + ["biases"] * (4 - n), events
