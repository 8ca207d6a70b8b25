"""Train a GPT-2-small-class byte-level transformer with FSDP2, compiled, with cgx2's quantized
reduce-scatter (cgx2.fsdp.compress; optionally its parameter all-gather, and HSDP's all-reduce
across replicas) or FSDP2's own. Logs tokens/s, loss and the bytes the
reduce-scatters and the parameter all-gathers sent against uncompressed FSDP2's:

    torchrun --nproc-per-node 4 examples/train_fsdp.py --bits 4      # one process per GPU
    torchrun --nproc-per-node 4 examples/train_fsdp.py --bits 32     # FSDP2's own
    torchrun --nproc-per-node 4 examples/train_fsdp.py --bits 4 --param-bits 8  # + all-gather
    torchrun --nproc-per-node 4 examples/train_fsdp.py --bits 4 --param-bits 8 \
        --keep-quantized-params  # the backward decodes the forward's gathered parameters
    torchrun --nproc-per-node 4 examples/train_fsdp.py --bits 4 --replicas 2    # HSDP, 2 x 2
    python examples/train_fsdp.py --bits 4 --dim 64 --layers 2 --steps 5 --no-compile  # 2 CPUs

The model (12 blocks, 768 wide, 12 heads: 85M parameters) is defined in train_ddp.py; the text
is Python's own standard library, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import add_model_options, add_run_options, parse, sent_said
from launch import launch
from train_ddp import CharTransformer, batch, load_text, train_step

import cgx2.fsdp
from cgx2.bench.report import HelpFormatter, Progress, add_bucket_size_argument, environment

_ALL_GATHER_CALL = inspect.signature(AllGather.__call__)


class CountedAllGather(AllGather):
    """An FSDP2 module's parameter all-gather (FSDP2's own or cgx2's), which counts the bytes
    this rank sent and what an uncompressed all-gather of the same input would have: the
    all-gathers are as much of FSDP2's traffic as its reduce-scatters."""

    def __init__(self, inner: AllGather) -> None:
        self.inner, self.bytes_sent, self.bytes_uncompressed = inner, 0, 0

    def allocate(self, size: tuple, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        """The inner all-gather, called as FSDP2 calls it (:class:`AllGather`'s arguments, by
        position or name), its bytes counted."""
        call = _ALL_GATHER_CALL.bind(self, *args, **kwargs).arguments
        before = getattr(self.inner, "bytes_sent", None)
        work = self.inner(*args, **kwargs)
        # Uncompressed, each rank's row goes to every other rank (a ring's bytes too).
        row = call["input_tensor"].numel() * call["input_tensor"].element_size()
        plain = (dist.get_world_size(call["group"]) - 1) * row
        self.bytes_uncompressed += plain
        self.bytes_sent += plain if before is None else self.inner.bytes_sent - before
        return work


def count_all_gathers(model: torch.nn.Module) -> list[CountedAllGather]:
    """Wrap every FSDP2 module's all-gather in a :class:`CountedAllGather` (none where this
    torch cannot set one)."""
    counted = []
    for module in model.modules():
        if not isinstance(module, FSDPModule) or not hasattr(module, "set_custom_all_gather"):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        inner = getattr(group, "_all_gather_comm", None)  # FSDP2's own, or cgx2's
        if inner is not None:
            counted.append(CountedAllGather(inner))
            module.set_custom_all_gather(counted[-1])
    return counted


def train(args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda"
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    if world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide {world} ranks")
    if args.replicas > 1:  # HSDP: each replica shards over world / replicas ranks
        mesh = init_device_mesh(
            "cuda" if cuda else "cpu",
            (args.replicas, world // args.replicas),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    torch.manual_seed(args.seed)
    model = CharTransformer(args.context, args.dim, args.layers, args.heads).to(device)
    params = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    comms = []
    if args.bits != 32:
        comms = cgx2.fsdp.compress(
            model,
            args.bits,
            args.bucket_size,
            args.min_size,
            param_bits=args.param_bits,
            keep_quantized_params=args.keep_quantized_params,
        )
    gathers = count_all_gathers(model) if comms else []
    if args.compile:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log_group = dist.new_group(backend="gloo")  # the loss log, apart from the gradients
    text = load_text(args.text_bytes)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses, times = [], []
    progress = Progress()  # rank 0 reports; a line rewritten in place only on a terminal
    for step in range(args.steps):
        x, y = batch(text, args.batch_size, args.context, gen, device)
        seconds, loss = train_step(model, opt, x, y, log_group)
        times.append(seconds)
        losses.append(loss)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            line = f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  {times[-1] * 1e3:.0f} ms"
            progress(line)
    progress.close()
    shards = world // args.replicas
    # An uncompressed reduce-scatter over S shards sends (S-1)/S of its fp32 input a step.
    scattered = args.steps * (shards - 1) * params * 4 // shards
    sent = sum(c.bytes_sent for c in comms) if comms else None
    gathered = sum(c.bytes_sent for c in gathers) if gathers else None
    gathered_plain = sum(c.bytes_uncompressed for c in gathers) if gathers else None
    del model, opt
    gc.collect()
    dist.barrier()
    n = min(10, len(losses))
    step_s = sorted(times[1:] or times)[len(times[1:] or times) // 2]  # step 1 compiles
    return {
        "env": environment(torch.device(device), world),
        "args": vars(args),
        "bits": args.bits,
        "world_size": world,
        "device": device,
        "params": params,
        "first_loss": losses[0],
        "final_loss": sum(losses[-n:]) / n,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": args.batch_size * args.context * world / step_s,
        # Both collectives, sent and uncompressed: the reduce-scatters' and the all-gathers'.
        "bytes_uncompressed": scattered + (gathered_plain or 0),
        "bytes_sent": None if sent is None else sent + (gathered or 0),
        "reduce_scatter_bytes_sent": sent,
        "reduce_scatter_bytes_uncompressed": scattered,
        "all_gather_bytes_sent": gathered,
        "all_gather_bytes_uncompressed": gathered_plain,
        "losses": losses,
    }


def report(result: dict, json_path: str | None) -> None:
    sent, plain = result["bytes_sent"], result["bytes_uncompressed"]
    saved = sent_said(sent, plain, digits=1)
    if sent and result.get("all_gather_bytes_sent") is not None:
        saved += " (reduce-scatter and parameter all-gather)"
    elif sent:
        saved += " (reduce-scatter only: this torch cannot count the all-gather)"
    params = result["args"].get("param_bits")
    kept = ", kept for the backward" if result["args"].get("keep_quantized_params") else ""
    print(
        f"{result['bits']}-bit FSDP2{f' ({params}-bit parameters{kept})' if params else ''}, "
        f"{result['world_size']} x {result['device']}, "
        f"{result['params'] / 1e6:.1f}M params: loss {result['first_loss']:.3f} -> "
        f"{result['final_loss']:.3f}, {result['step_ms']:.0f} ms/step, "
        f"{result['tokens_per_s']:.0f} tokens/s{saved}"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--bits", type=int, default=4, help="1-8, or 32 for FSDP2's own")
    p.add_argument("--param-bits", type=int, help="1-8: also all-gather parameters quantized")
    p.add_argument(
        "--keep-quantized-params",
        action="store_true",
        help="with --param-bits: each block's backward decodes the rows its forward gathered "
        "instead of gathering them again (one parameter all-gather a step; the payload held "
        "from forward to backward)",
    )
    p.add_argument("--replicas", type=int, default=1, help="HSDP: replicas (mesh rows)")
    add_bucket_size_argument(p)
    p.add_argument("--min-size", type=int, default=1024, help="smaller or 1-D params: exact")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    add_model_options(p, batch_size=8, context=1024, dim=768, layers=12, heads=12, lr=6e-4)
    p.add_argument("--bf16", action="store_true", help="bf16 parameters (fp32 reduction)")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run eagerly, without torch.compile",
    )
    add_run_options(p, text_bytes=4_000_000)
    p.add_argument("--log-every", type=int, default=5, help="steps between progress lines")
    p.add_argument("--json", help="write the result here")
    args = parse(p, argv)
    if not (1 <= args.bits <= 8 or args.bits == 32):
        p.error("--bits must be in 1..8, or 32")
    if args.param_bits is not None and not (1 <= args.param_bits <= 8 and args.bits != 32):
        p.error("--param-bits must be in 1..8, with --bits in 1..8")
    if args.keep_quantized_params and args.param_bits is None:
        p.error("--keep-quantized-params needs --param-bits")
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = launch(train, args)
    if result is not None:
        report(result, args.json)


if __name__ == "__main__":
    main()
