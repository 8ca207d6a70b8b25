"""The small classification task that the DDP, FSDP and backend tests train on: a rank's batch,
one step's loss and backward, a two-layer model, and a model sharded part by part."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def batch(
    seed: int, shape: tuple[int, int] = (64, 32), sign_column: int | None = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """``shape`` normal values drawn from a generator seeded ``seed``, each row labelled by which
    of its first four values is largest, moved one class on (mod 4) where column
    ``sign_column`` is positive (None: not moved)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    y = x[:, :4].argmax(dim=1)
    if sign_column is not None:
        y = (y + (x[:, sign_column] > 0).long()) % 4
    return x, y


def backward(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """``opt``'s gradients zeroed, then the cross-entropy of ``model(x)`` against ``y`` and its
    backward pass; the loss."""
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


class TwoLayers(nn.Module):
    """``fc2(relu(fc1(x)))``: ``inputs`` to ``hidden`` to 4 classes."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def shard(model: nn.Module, parts: Iterable[nn.Module], **kwargs: object) -> None:
    """FSDP2 over every rank (a CPU mesh): each of ``parts``, then ``model``, with ``kwargs``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for part in parts:
        fully_shard(part, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
