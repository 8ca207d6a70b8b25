"""Train with Hugging Face Accelerate's FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``:
each transformer block and the root sharded by ``fully_shard``), the reduce-scatters quantized
by ``cgx2.fsdp.compress`` on the model ``accelerator.prepare`` returns; reports the bytes sent
and whether the ranks agree on the parameters:

    accelerate launch --num_processes 4 examples/accelerate_fsdp.py          # GPUs
    torchrun --nproc-per-node 4 examples/accelerate_fsdp.py --bits 32        # FSDP2's own

GPUs only: Accelerate (1.15) turns FSDP on only for accelerator devices (its AcceleratorState
sets DistributedType.FSDP for MULTI_GPU, MULTI_XPU, ..., never MULTI_CPU); on CPUs it ignores
the plugin and prepare() returns DDP, which this script refuses (run accelerate_ddp.py there).
The model and text are train_ddp.py's.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import set_seed
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import add_recipe_options
from recipe_parts import accelerate_train, fsdp_bytes_uncompressed, recipe_windows
from recipe_report import report
from train_ddp import CharTransformer

import cgx2.fsdp


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, default=4, help="32: FSDP2's own reduce-scatter")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters in forward/backward")
    p.add_argument("--cpu", action="store_true", help="Accelerate's: CPUs (refused: see above)")
    add_recipe_options(p)
    args = p.parse_args(argv)

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],  # train_ddp.py's transformer block
        reshard_after_forward=True,
        mixed_precision_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32
        ),
    )
    accelerator = Accelerator(cpu=args.cpu, fsdp_plugin=plugin)
    if not accelerator.is_fsdp2:
        raise SystemExit(
            f"Accelerate did not turn FSDP2 on (distributed type {accelerator.distributed_type}): "
            "it runs FSDP only on accelerator devices, not on CPUs"
        )
    set_seed(0)
    model = CharTransformer(args.context, args.dim, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt = accelerator.prepare(model, opt)  # FSDP2 needs both in one call
    comms = []
    if args.bits != 32:  # the line cgx2 adds, after fully_shard (done by prepare)
        comms = cgx2.fsdp.compress(model, bits=args.bits)
    world = accelerator.num_processes
    data = recipe_windows(args, world)
    loader = accelerator.prepare(DataLoader(data, batch_size=args.batch_size))

    steps = accelerate_train(accelerator, model, opt, loader)
    numel = sum(p.numel() for p in model.parameters())
    report(
        args.json,
        model,
        bits=args.bits,
        distributed_type=str(accelerator.distributed_type),
        steps=steps,
        bytes_sent=sum(c.bytes_sent for c in comms),
        bytes_uncompressed=fsdp_bytes_uncompressed(steps, world, numel),
    )
    # The sharded model goes while the process group lives, as in accelerate_ddp.py and
    # torchtitan_fsdp.py: destroyed after it, gloo's teardown could hang or abort at exit.
    accelerator.free_memory()
    del model, opt, loader, comms
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
