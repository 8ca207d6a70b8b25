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
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_ddp import windows
from recipe_report import report
from train_ddp import CharTransformer, load_text

from cgx2.ddp import CGXState, GlobalQSGDState, cgx_hook, standard_dithering_hook


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hook", choices=("cgx", "gqsgd", "none"), default="cgx")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--cpu", action="store_true", help="Accelerate's: train on CPUs (gloo)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", help="write the ranks' bytes and parameter digests here")
    args = p.parse_args(argv)

    accelerator = Accelerator(cpu=args.cpu)
    set_seed(0)
    model = CharTransformer(args.context, args.dim, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    world = accelerator.num_processes
    data = windows(load_text(1 << 20), args.steps * args.batch_size * world, args.context, 0)
    loader = DataLoader(data, batch_size=args.batch_size)  # sharded by Accelerate
    model, opt, loader = accelerator.prepare(model, opt, loader)

    if args.hook == "cgx":
        # The first backward pass is sent exact (start_iter=1, as CGX did); layers under
        # 1024 values (biases, norms) always.
        state, hook = CGXState(None, 1024, {"bits": args.bits, "bucket_size": 512}), cgx_hook
    elif args.hook == "gqsgd":
        state, hook = GlobalQSGDState(None, bits=args.bits), standard_dithering_hook
    else:
        state = hook = None
    if hook is not None:
        if not isinstance(model, DistributedDataParallel):
            raise SystemExit(
                f"prepare() gave a {type(model).__name__}, not DistributedDataParallel "
                f"(distributed type {accelerator.distributed_type}): launch 2 or more processes"
            )
        model.register_comm_hook(state, hook)

    steps = 0
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    accelerator.print(f"{steps} steps, last loss {loss.item():.4f}")

    numel = sum(p.numel() for p in model.parameters())
    # Global-QSGD's state counts only what it sent; uncompressed, DDP's ring allreduce sends
    # 2 (W - 1) / W of every fp32 gradient each step.
    plain = steps * 2 * (world - 1) * 4 * numel // world
    report(
        args.json,
        accelerator.unwrap_model(model),
        hook=args.hook,
        distributed_type=str(accelerator.distributed_type),
        steps=steps,
        bytes_sent=getattr(state, "bytes_sent", 0),
        bytes_uncompressed=getattr(state, "bytes_uncompressed", plain if state else 0),
    )
    # Release the DDP model while its process group lives: destroyed after the group (when
    # main() returns), its destructor could wait forever on gloo.
    accelerator.free_memory()
    del model, opt, loader
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
