"""Train with PyTorch Lightning's DDP, the gradients compressed by cgx2's DDP hooks (CGX's
cgx_hook, or Global-QSGD's standard dithering), and report the bytes sent and whether the ranks
agree on the trained parameters:

    python examples/lightning_ddp.py --devices 4                    # GPUs: Lightning starts them
    python examples/lightning_ddp.py --hook gqsgd --devices 4       # Global-QSGD's hook
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --accelerator cpu --steps 5  # 2 CPUs

On GPUs the hook goes in through Lightning's own arguments, ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)``. Lightning registers those only when the device is CUDA (its
``DDPStrategy._register_ddp_hooks``), so on CPUs a callback registers the hook on the DDP model
Lightning made (``--via callback``; it works on GPUs too). The model and text are
train_ddp.py's (a byte-level transformer on Python's standard library: nothing to download).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import add_recipe_options
from recipe_parts import (
    LIGHTNING_QUIET,
    ddp_bytes_uncompressed,
    ddp_hook,
    lightning_fit,
    next_byte_loss,
)
from recipe_report import report
from train_ddp import CharTransformer


class LitLM(L.LightningModule):
    """train_ddp.py's byte-level transformer as a LightningModule."""

    def __init__(self, context: int, dim: int, layers: int, heads: int, lr: float) -> None:
        super().__init__()
        self.model = CharTransformer(context, dim, layers, heads)
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, ...], _: int) -> torch.Tensor:
        return next_byte_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class CompressGradients(Callback):
    """Registers a DDP communication hook on the ``DistributedDataParallel`` model Lightning
    made (it is made in the strategy's setup, before ``on_fit_start``), on any device."""

    def __init__(self, state: object, hook: object) -> None:
        self.state, self.hook = state, hook

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(self.state, self.hook)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hook", choices=("cgx", "gqsgd", "none"), default="cgx")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument(
        "--via",
        choices=("strategy", "callback"),
        default=None,
        help="how the hook goes in (default: strategy on GPUs, callback on CPUs)",
    )
    p.add_argument("--accelerator", default="auto", help="Lightning's: gpu, cpu, auto")
    p.add_argument("--devices", type=int, default=2)
    add_recipe_options(p)
    args = p.parse_args(argv)

    L.seed_everything(0, verbose=False)
    state, hook = ddp_hook(args.hook, args.bits)
    cuda = args.accelerator in ("gpu", "cuda") or (
        args.accelerator == "auto" and torch.cuda.is_available()
    )
    via = args.via or ("strategy" if cuda else "callback")
    callbacks = []
    if hook is None:
        strategy = DDPStrategy()
    elif via == "strategy":  # Lightning's own arguments: registered on CUDA devices only
        strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)
    else:
        strategy = DDPStrategy()
        callbacks.append(CompressGradients(state, hook))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        callbacks=callbacks,
        max_steps=args.steps,
        **LIGHTNING_QUIET,
    )
    module = LitLM(args.context, args.dim, args.layers, args.heads, args.lr)
    numel, world = lightning_fit(trainer, module, args), trainer.world_size
    report(
        args.json,
        module,
        hook=args.hook,
        via=via,
        steps=trainer.global_step,
        bytes_sent=getattr(state, "bytes_sent", 0),
        bytes_uncompressed=ddp_bytes_uncompressed(state, trainer.global_step, world, numel),
    )
    # Lightning leaves the process group up after fit. The model goes first, while the group
    # lives, then the group: either left to the interpreter's exit, gloo's teardown could
    # abort the process ("terminate called without an active exception").
    del trainer, module
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
