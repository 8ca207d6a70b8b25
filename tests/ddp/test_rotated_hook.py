"""cgx_hook with the rotated codec (``rotation="hadamard"``) at 2 and 3 bits, with and without
error feedback: gradients alike on every rank and equal to the rotated allreduce's, checked
before anything is sent, and examples/train_ddp.py at 2 bits rotated within the 4-bit
tolerance of tests/tools/test_train_example.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx2 import seeding
from cgx2.collectives import reference_allreduce
from cgx2.collectives.agreement import DisagreementError
from cgx2.ddp import CGXState, cgx_hook

EXAMPLES = Path(__file__).parents[2] / "examples"


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 64, generator=g)
    x[:, 0] *= 30  # an outlier feature: fc1's gradient has outlier columns
    return x, (x[:, 1] > 0).long() + 2 * (x[:, 2] > 0).long()


def _train(params: dict, error_feedback: bool, steps: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    seeding.manual_seed(3)
    model = DDP(_Net())
    state = CGXState(None, 1024, params, start_iter=0, error_feedback=error_feedback)
    model.register_comm_hook(state, cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, losses = [], []
    for step in range(steps):
        x, y = _batch(rank, step % 4)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads.append(model.module.fc1.weight.grad.clone())
        opt.step()
        losses.append(loss.item())
    residual = None
    if state.errors is not None:
        residual = [r.clone() for r in state.errors._residuals.values()]
    return {"grads": grads, "losses": losses, "state": state.state_dict(), "residual": residual}


def _plain_grad(rank: int) -> torch.Tensor:
    torch.manual_seed(0)
    model = _Net()
    x, y = _batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    return model.fc1.weight.grad


@pytest.mark.parametrize(
    "bits, error_feedback, rotation",
    [
        (2, False, "hadamard"),
        (2, True, "hadamard"),
        (3, False, "hadamard"),
        (3, True, "hadamard"),
        (2, False, "hadamard-clipped"),
        (3, True, "hadamard-clipped"),
    ],
)
def test_the_rotated_hook_agrees_on_every_rank_and_is_the_rotated_allreduce(
    dist2, bits, error_feedback, rotation
):
    """fc1's gradient (4096 values, the one compressed layer) is the rotated quantized
    allreduce's average, the same bits on both ranks; with error feedback the residual is
    the gradient minus what the peer decodes, in the gradient's own domain; rotation and its
    block travel in the checkpoint."""
    params = {"bits": bits, "bucket_size": 512, "rotation": rotation, "rotation_block": 256}
    results = dist2.run(_train, params, error_feedback, 3)
    for step in range(3):
        assert torch.equal(results[0]["grads"][step], results[1]["grads"][step])
    # The first step's gradient: the rotated allreduce's average of the ranks' own, bit for
    # bit (the hook's first call draws the stream's first seed), and not the unrotated one's.
    inputs = [_plain_grad(0).reshape(-1), _plain_grad(1).reshape(-1)]
    seed = seeding.call_seed(3, 0)
    model = reference_allreduce(
        inputs, bits, 512, seed, "avg", rotation=rotation, rotation_block=256
    )
    first = results[0]["grads"][0].reshape(-1)
    assert torch.equal(first, model)
    assert not torch.equal(first, reference_allreduce(inputs, bits, 512, seed, "avg"))
    assert results[0]["state"]["rotation"] == rotation
    assert results[0]["state"]["rotation_block"] == 256
    if error_feedback:
        for r in results:
            assert r["residual"] and all(torch.isfinite(x).all() for x in r["residual"])


def _unrotated_vs_rotated(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    base = {"bits": bits, "bucket_size": 512}
    rotated = _train({**base, "rotation": "hadamard"}, False, 1)["grads"][0]
    plain = _train(base, False, 1)["grads"][0]
    return rotated, plain


def test_rotation_cuts_the_2_bit_error_of_a_gradient_with_outlier_columns(dist2):
    rotated, unrotated = dist2.run(_unrotated_vs_rotated, 2)[0]
    exact = (_plain_grad(0) + _plain_grad(1)) / 2
    assert (rotated - exact).norm() < 0.8 * (unrotated - exact).norm()


def test_bad_rotations_are_refused_when_the_state_is_made():
    with pytest.raises(ValueError, match=r"compression_params\['rotation_block'\].*must divide"):
        CGXState(None, 1024, {"bits": 2, "rotation": "hadamard"}, rotation_block=1024)
    with pytest.raises(ValueError, match=r"compression_params\['rotation'\] must be None"):
        CGXState(None, 1024, {"bits": 2}, rotation="walsh")
    with pytest.raises(ValueError, match="differ"):
        CGXState(None, 1024, {"bits": 2, "rotation": "hadamard"}, rotation="none")
    state = CGXState(None, 1024, {"bits": 2}, rotation="hadamard")
    assert (state.rotation, state.rotation_block) == ("hadamard", 128)
    assert CGXState(None, 1024, {"bits": 2}).rotation is None


def _mismatched_hook() -> str:
    rotation = "hadamard" if dist.get_rank() == 0 else None
    try:
        _train({"bits": 2, "bucket_size": 512, "rotation": rotation}, False, 1)
    except DisagreementError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_rotations_are_told_at_the_first_bucket(dist2):
    for message in dist2.run(_mismatched_hook):
        assert "rotation" in message and "hadamard" in message, message


def _run_example(tmp_path: Path, bits: int, steps: int, rotation: str | None) -> dict:
    out = tmp_path / f"bits{bits}_{rotation}.json"
    args = f"--bits {bits} --steps {steps} --log-every 20 --mode hook --device cpu".split()
    if rotation is not None:
        args += ["--rotation", rotation]
    cmd = [sys.executable, str(EXAMPLES / "train_ddp.py"), *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=EXAMPLES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_two_bits_rotated_train_within_the_four_bit_tolerance(tmp_path):
    """examples/train_ddp.py (same seed, data, 40 AdamW steps) with cgx_hook at 2 bits and
    rotation="hadamard": the final loss within 3% of plain DDP's, the tolerance
    tests/tools/test_train_example.py gives 4 bits, at about 60% of 4-bit's bytes. (On this
    small task 2 bits unrotated also stays within it: this holds that the rotation trains, the
    test above that it cuts the error where outliers stretch the buckets.)"""
    plain = _run_example(tmp_path, 32, 40, None)
    two = _run_example(tmp_path, 2, 40, "hadamard")
    assert two["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-6)
    assert abs(two["final_loss"] - plain["final_loss"]) <= 0.03 * plain["final_loss"], (
        two["final_loss"],
        plain["final_loss"],
    )
    assert two["rotation"] == "hadamard" and plain["rotation"] is None
    assert two["bytes_uncompressed"] / two["bytes_sent"] > 9
