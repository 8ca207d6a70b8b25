"""What the framework recipes (lightning_*.py, accelerate_*.py) share besides their options and
report: the DDP hook by name, the training windows, Lightning's quiet trainer, Accelerate's loop."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from train_ddp import load_text

from cgx2.ddp import CGXState, GlobalQSGDState, cgx_hook, standard_dithering_hook

# L.Trainer's arguments for a run that prints only the recipe's own lines and writes no files.
LIGHTNING_QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def ddp_hook(name: str, bits: int) -> tuple[object | None, Callable | None]:
    """``--hook``'s (state, hook): "cgx", "gqsgd" (Global-QSGD) or "none" (None, None)."""
    if name == "cgx":
        # The first backward pass is sent exact (start_iter=1, as CGX did); layers under
        # 1024 values (biases, norms) always.
        return CGXState(None, 1024, {"bits": bits, "bucket_size": 512}), cgx_hook
    if name == "gqsgd":
        return GlobalQSGDState(None, bits=bits), standard_dithering_hook
    return None, None


def ddp_bytes_uncompressed(state: object | None, steps: int, world: int, numel: int) -> int:
    """What ``state``'s hook would have sent uncompressed (0 without a hook). Global-QSGD's
    state counts only what it sent; uncompressed, DDP's ring allreduce sends 2 (W - 1) / W of
    every fp32 gradient each step."""
    plain = steps * 2 * (world - 1) * 4 * numel // world
    return getattr(state, "bytes_uncompressed", plain if state else 0)


def fsdp_bytes_uncompressed(steps: int, shards: int, numel: int) -> int:
    """FSDP2's own reduce-scatter sends (S - 1) / S of every fp32 gradient each step."""
    return steps * (shards - 1) * 4 * numel // shards


def windows(text: torch.Tensor, count: int, context: int, seed: int) -> TensorDataset:
    """``count`` (input, next bytes) windows of ``text`` at random offsets."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, text.numel() - context - 1, (count,), generator=gen)
    seq = text[starts[:, None] + torch.arange(context + 1)].long()
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def recipe_windows(args: argparse.Namespace, world: int) -> TensorDataset:
    """The training text's windows for ``--steps`` batches of ``--batch-size`` on each of
    ``world`` ranks (the framework's loader shards them)."""
    return windows(load_text(1 << 20), args.steps * args.batch_size * world, args.context, seed=0)


def lightning_fit(trainer: object, module: nn.Module, args: argparse.Namespace) -> int:
    """``trainer.fit`` on the recipe's windows (sharded by Lightning); returns the number of
    parameters ``module`` trained."""
    data = recipe_windows(args, trainer.world_size)
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size))
    return sum(p.numel() for p in module.parameters())


def next_byte_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The cross entropy of ``model``'s next-byte predictions on an (input, next bytes) batch."""
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def accelerate_train(
    accelerator: object, model: nn.Module, opt: torch.optim.Optimizer, loader: Iterable
) -> int:
    """One pass over ``loader`` with ``accelerator.backward``; prints the last loss and returns
    the steps taken."""
    steps = 0
    for batch in loader:
        loss = next_byte_loss(model, batch)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    accelerator.print(f"{steps} steps, last loss {loss.item():.4f}")
    return steps
