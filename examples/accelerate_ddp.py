"""Train with Hugging Face Accelerate's DDP, the gradients compressed by cgx2's DDP hooks (CGX's
cgx_hook, or Global-QSGD's standard dithering), and report the bytes sent and whether the ranks
agree on the trained parameters:

    accelerate launch --num_processes 4 examples/accelerate_ddp.py              # GPUs
    accelerate launch --num_processes 4 examples/accelerate_ddp.py --hook gqsgd
    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --cpu --steps 5      # 2 CPUs

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's own hooks (a
``DDPCommunicationHookType``: fp16, bf16, PowerSGD), so cgx2's hook is registered on the
``DistributedDataParallel`` model that ``accelerator.prepare`` returns, before the first
backward pass. The model and text are train_ddp.py's.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import add_recipe_options
from recipe_parts import accelerate_train, ddp_bytes_uncompressed, ddp_hook, recipe_windows
from recipe_report import report
from train_ddp import CharTransformer


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hook", choices=("cgx", "gqsgd", "none"), default="cgx")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--cpu", action="store_true", help="Accelerate's: train on CPUs (gloo)")
    add_recipe_options(p)
    args = p.parse_args(argv)

    accelerator = Accelerator(cpu=args.cpu)
    set_seed(0)
    model = CharTransformer(args.context, args.dim, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    world = accelerator.num_processes
    data = recipe_windows(args, world)
    loader = DataLoader(data, batch_size=args.batch_size)  # sharded by Accelerate
    model, opt, loader = accelerator.prepare(model, opt, loader)

    state, hook = ddp_hook(args.hook, args.bits)
    if hook is not None:
        if not isinstance(model, DistributedDataParallel):
            raise SystemExit(
                f"prepare() gave a {type(model).__name__}, not DistributedDataParallel "
                f"(distributed type {accelerator.distributed_type}): launch 2 or more processes"
            )
        model.register_comm_hook(state, hook)

    steps = accelerate_train(accelerator, model, opt, loader)
    numel = sum(p.numel() for p in model.parameters())
    report(
        args.json,
        accelerator.unwrap_model(model),
        hook=args.hook,
        distributed_type=str(accelerator.distributed_type),
        steps=steps,
        bytes_sent=getattr(state, "bytes_sent", 0),
        bytes_uncompressed=ddp_bytes_uncompressed(state, steps, world, numel),
    )
    # Release the DDP model while its process group lives: destroyed after the group (when
    # main() returns), its destructor could wait forever on gloo.
    accelerator.free_memory()
    del model, opt, loader
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
