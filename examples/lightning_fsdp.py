"""Train with PyTorch Lightning's FSDP2 path (ModelParallelStrategy: the LightningModule shards
itself in configure_model with fully_shard), the reduce-scatters quantized by
cgx2.fsdp.compress, and report the bytes sent and whether the ranks agree on the parameters:

    python examples/lightning_fsdp.py --devices 4                   # GPUs: Lightning starts them
    python examples/lightning_fsdp.py --devices 4 --bf16            # bf16 compute, fp32 reduce
    torchrun --nproc-per-node 2 examples/lightning_fsdp.py --accelerator cpu --steps 5  # 2 CPUs

Lightning's own FSDPStrategy wraps in FSDP1 (FullyShardedDataParallel), whose communication
cgx2 does not replace; ModelParallelStrategy leaves the sharding to you, which is where
cgx2.fsdp.compress goes, right after fully_shard. The model and text are train_ddp.py's.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import add_recipe_options
from recipe_parts import LIGHTNING_QUIET, fsdp_bytes_uncompressed, lightning_fit, next_byte_loss
from recipe_report import report
from train_ddp import CharTransformer

import cgx2.fsdp


class LitLM(L.LightningModule):
    """train_ddp.py's byte-level transformer, sharded with FSDP2 and compressed by cgx2."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = CharTransformer(args.context, args.dim, args.layers, args.heads)
        self.comms: list[cgx2.fsdp.QuantizedReduceScatter] = []

    def configure_model(self) -> None:
        # ModelParallelStrategy's mesh is (data_parallel, tensor_parallel); with
        # tensor_parallel_size=1 the data-parallel dimension holds every rank.
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if self.args.bf16 else None, reduce_dtype=torch.float32
        )
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        if self.args.bits != 32:
            self.comms = cgx2.fsdp.compress(self.model, bits=self.args.bits, min_size=1024)

    def training_step(self, batch: tuple[torch.Tensor, ...], _: int) -> torch.Tensor:
        return next_byte_loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, default=4, help="32: FSDP2's own reduce-scatter")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters in forward/backward")
    p.add_argument("--accelerator", default="auto", help="Lightning's: gpu, cpu, auto")
    p.add_argument("--devices", type=int, default=2)
    add_recipe_options(p)
    args = p.parse_args(argv)

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1),
        max_steps=args.steps,
        **LIGHTNING_QUIET,
    )
    module = LitLM(args)
    numel, world = lightning_fit(trainer, module, args), trainer.world_size
    report(
        args.json,
        module,
        bits=args.bits,
        steps=trainer.global_step,
        bytes_sent=sum(c.bytes_sent for c in module.comms),
        bytes_uncompressed=fsdp_bytes_uncompressed(trainer.global_step, world, numel),
    )
    # Lightning leaves the process group up after fit. The model goes first, while the group
    # lives, then the group: either left to the interpreter's exit, gloo's teardown could
    # abort the process ("terminate called without an active exception").
    del trainer, module
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
