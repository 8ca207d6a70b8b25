"""cgx2.fsdp.compress(..., keep_quantized_params=True): the backward decodes the forward's
gathered parameter rows again instead of gathering them again: the same training bit for bit,
one gather a step where FSDP reshards after forward, and a fresh gather after a change."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from toy_task import batch

import cgx2
from cgx2.fsdp import QuantizedAllGather, compress


class _Net(nn.Module):
    """Three sharded layers between two of the root's own (compressed ``inp``, exact
    ``out``): the root is not resharded after forward, the layers are. ``checkpointed``: each
    layer's activations recomputed in the backward (non-reentrant activation checkpointing)."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.inp = nn.Linear(32, 64)
        self.layers = nn.ModuleList([nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64)])
        self.out = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for layer in self.layers:
            x = torch.relu(
                checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
            )
        return self.out(x)


def _change(model: _Net, how: str) -> None:
    """An in-place change of ``layers[1]``'s weight between forward and backward, alike on
    every rank: of the sharded DTensor, or of its local tensor."""
    weight = model.layers[1].weight
    with torch.no_grad():
        if how == "dtensor":
            weight.add_(0.01)
        else:
            weight.to_local().add_(0.01)


def _train(
    keep: bool,
    steps: int,
    bf16: bool = False,
    change: str | None = None,
    resharded: bool = True,
    checkpointed: bool = False,
    compiled: bool = False,
    hsdp: bool = False,
) -> dict:
    """``steps`` AdamW steps of :class:`_Net`, FSDP2 with 4-bit gradients and 8-bit
    parameters (every gather quantized), ``layers[1]`` resharded after forward or not."""
    world = dist.get_world_size()
    names = ("replicate", "shard") if hsdp else None
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,), mesh_dim_names=names)
    torch.manual_seed(0)
    model = _Net(checkpointed)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=resharded or i != 1)
        if compiled:
            layer.compile()
    fully_shard(model, mesh=mesh, mp_policy=policy)
    compress(model, bits=4, bucket_size=128, param_bits=8, keep_quantized_params=keep)
    modules = [model, *model.layers]
    gathers = [m._get_fsdp_state()._fsdp_param_group._all_gather_comm for m in modules]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cgx2.manual_seed(1)
    losses, kept_after_forward, kept_after_backward = [], [], []
    with cgx2.config.tuned(crossover_bytes=0):  # every compressed gather quantized
        for step in range(steps):
            x, y = batch(10 * step + dist.get_rank(), sign_column=5)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            kept_after_forward.append([g.kept_bytes for g in gathers])
            if change is not None and step == steps - 1:
                _change(model, change)
            loss.backward()
            kept_after_backward.append([g.kept_bytes for g in gathers])
            losses.append(loss.item())
            if step < steps - 1:
                opt.step()
    return {
        "losses": losses,
        "shards": [p.to_local().detach().clone() for p in model.parameters()],
        "grads": [p.grad.to_local().clone() for p in model.parameters()],
        "sent": [g.bytes_sent for g in gathers],
        "reused": [g.reused for g in gathers],
        "kept_after_forward": kept_after_forward,
        "kept_after_backward": kept_after_backward,
    }


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("bf16", [False, True])
def test_kept_rows_train_bit_identically_with_half_the_gathers(dist2, bf16):
    steps = 4
    off = dist2.run(_train, False, steps, bf16)
    on = dist2.run(_train, True, steps, bf16)
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on["losses"] == r_off["losses"]
        assert _same(r_on["shards"], r_off["shards"])
        assert _same(r_on["grads"], r_off["grads"])
        # The root gathers once a step either way; each layer twice, or once with its rows
        # kept: every backward served from the forward's rows, exactly half the bytes.
        assert r_off["reused"] == [0, 0, 0, 0]
        assert r_on["reused"] == [0, steps, steps, steps]
        assert r_on["sent"][0] == r_off["sent"][0] > 0
        assert [2 * s for s in r_on["sent"][1:]] == r_off["sent"][1:]
        # Held from each layer's forward to its backward, never by the root, then dropped.
        for kept in r_on["kept_after_forward"]:
            assert kept[0] == 0 and all(k > 0 for k in kept[1:])
        assert all(kept == [0, 0, 0, 0] for kept in r_on["kept_after_backward"])


def test_recomputed_activations_are_served_by_the_kept_rows(dist2):
    """With activation checkpointing the backward's recomputation runs each layer's forward
    again: FSDP has unsharded it by then (its pre-backward gather, served from the kept
    rows), so the recomputation gathers nothing."""
    on = dist2.run(_train, True, 3, False, None, True, True)
    off = dist2.run(_train, False, 3, False, None, True, True)
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on["losses"] == r_off["losses"] and _same(r_on["grads"], r_off["grads"])
        assert r_on["reused"] == [0, 3, 3, 3]
        assert [2 * s for s in r_on["sent"][1:]] == r_off["sent"][1:]


@pytest.mark.slow
def test_compiled_layers_keep_alike(dist2):
    on = dist2.run(_train, True, 3, False, None, True, False, True)
    off = dist2.run(_train, False, 3, False, None, True, False, True)
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on["losses"] == r_off["losses"] and _same(r_on["grads"], r_off["grads"])
        assert r_on["reused"] == [0, 3, 3, 3]


@pytest.mark.slow
def test_hsdp_keeps_the_rows_gathered_inside_a_replica(dist4):
    on = dist4.run(_train, True, 3, False, None, True, False, False, True)
    off = dist4.run(_train, False, 3, False, None, True, False, False, True)
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on["losses"] == r_off["losses"] and _same(r_on["grads"], r_off["grads"])
        assert r_on["reused"] == [0, 3, 3, 3]
        assert [2 * s for s in r_on["sent"][1:]] == r_off["sent"][1:]


def test_a_layer_not_resharded_after_forward_keeps_nothing(dist2):
    on = dist2.run(_train, True, 3, False, None, False)
    off = dist2.run(_train, False, 3, False, None, False)
    for r_on, r_off in zip(on, off, strict=True):
        assert r_on["losses"] == r_off["losses"]
        assert all(kept[2] == 0 for kept in r_on["kept_after_forward"])
        assert r_on["reused"][2] == 0 and r_on["sent"][2] == r_off["sent"][2]
        assert r_on["reused"][1] == 3 and 2 * r_on["sent"][1] == r_off["sent"][1]


@pytest.mark.parametrize("how", ["dtensor", "local"])
def test_a_change_between_forward_and_backward_gathers_again(dist2, how):
    steps = 3
    off = dist2.run(_train, False, steps, False, how)
    on = dist2.run(_train, True, steps, False, how)
    unchanged = dist2.run(_train, True, steps, False)
    for r_on, r_off, r_same in zip(on, off, unchanged, strict=True):
        # The backward computed with the changed parameters, as gathering again does.
        assert _same(r_on["grads"], r_off["grads"])
        assert not _same(r_on["grads"], r_same["grads"])
        assert r_on["reused"] == [0, steps, steps - 1, steps]


def test_bad_arguments_fail_clearly():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"keep_quantized_params.*param_bits"):
        compress(model, bits=4, keep_quantized_params=True)
    with pytest.raises(TypeError, match="keep_quantized_params must be a bool, got int"):
        compress(model, bits=4, param_bits=8, keep_quantized_params=1)
    with pytest.raises(ValueError, match="keep_quantized_params needs param_group"):
        QuantizedAllGather(8, 128, keep_quantized_params=True)
    with pytest.raises(TypeError, match="keep_quantized_params must be a bool"):
        QuantizedAllGather(8, 128, keep_quantized_params="yes", param_group=object())


def _keep_differs() -> tuple[str, str]:
    """A step where only rank 0 keeps its rows: the error's type and message."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    keep = dist.get_rank() == 0
    compress(model, bits=4, bucket_size=128, param_bits=8, keep_quantized_params=keep)
    try:
        model(batch(0, sign_column=5)[0]).sum().backward()
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e)
    return "", ""


def test_ranks_that_keep_differently_raise_at_the_first_gather(dist2):
    """A rank that decoded its kept rows while the others gathered would hang them."""
    for error, message in dist2.run(_keep_differs):
        assert error == "DisagreementError", message
        assert "keep_quantized_params=[rank 0: True, rank 1: False]" in message, message
