"""Train a small byte-level transformer with DDP and cgx2's 4-bit gradients.

The text is Python's own standard library source, so nothing is downloaded. CPU with gloo by
default (2 processes), CUDA with NCCL when present; under torchrun it uses the launcher's
processes. --mode hook registers cgx_hook (--hook picks a Global-QSGD hook instead);
--mode compress calls cgx2.ddp.compress, which registers it only where compression pays;
--mode backend runs plain DDP on the cgx backend (CGX's other way in); --compile compiles the
model under DDP; --optimizer-in-backward steps AdamW in the hook, bucket by bucket as each
bucket's gradient arrives, not after the backward pass. Logs loss, step time and the bytes sent
against uncompressed DDP; --compare trains plain DDP first, from the same seed, and reports the
step time against it:

    python examples/train_ddp.py --bits 4 --steps 200            # spawns 2 CPU processes
    python examples/train_ddp.py --bits 4 --compare              # and against plain DDP
    torchrun --nproc-per-node 4 examples/train_ddp.py --bits 4     # one process per GPU
    torchrun --nproc-per-node 4 examples/train_ddp.py --mode compress  # the hook where it pays
    mpirun -np 2 python examples/train_ddp.py --mode backend      # CGX's launcher
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx2.ddp
from cgx2.bench.report import (
    HelpFormatter,
    Progress,
    add_bucket_size_argument,
    add_choice,
    environment,
)
from cgx2.collectives import graphs
from cgx2.collectives.fusion import ring_bytes_sent
from cgx2.ddp import CGXState, GlobalQSGDState, cgx_hook, optimizer_in_hook
from cgx2.ddp import global_qsgd as gq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import add_model_options, add_run_options, parse
from launch import launch


def load_text(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, in a fixed order, as a uint8 tensor."""
    root = Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """A byte-level GPT (``vocab`` symbols: 256 bytes), learned positions, pre-norm blocks."""

    def __init__(self, context: int, dim: int, layers: int, heads: int, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.mask[: tokens.shape[1], : tokens.shape[1]])
        return self.head(self.norm(x))


def batch(
    text: torch.Tensor, size: int, context: int, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, text.numel() - context - 1, (size,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    seq = text[idx].long().to(device)
    return seq[:, :-1], seq[:, 1:]


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    log_group: dist.ProcessGroup,
) -> tuple[float, float]:
    """One optimizer step of ``model`` on ``(x, y)``: its seconds (the GPU's work included) and
    its loss averaged over the ranks (through ``log_group``, apart from the gradients'
    collectives, after the step's timing)."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    opt.step()
    if x.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    mean = loss.detach().cpu()
    dist.all_reduce(mean, group=log_group)
    return seconds, mean.item() / dist.get_world_size()


def train(args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.verbose and rank == 0:  # what cgx2 measures and decides at first use
        logging.basicConfig(format="%(message)s")
        logging.getLogger("cgx2").setLevel(logging.INFO)
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP broadcasts them too)
    model = CharTransformer(args.context, args.dim, args.layers, args.heads).to(device)
    ddp = DDP(model)
    # The loss is averaged for the log on a plain group, so that only gradients are counted.
    log_group = dist.new_group(backend="gloo")
    group = dist.group.WORLD
    state = hook = None
    in_backward = {"optimizer": torch.optim.AdamW, "optimizer_kwargs": {"lr": args.lr}}
    if args.mode == "compress" and args.bits != 32:
        # The recommended way: cgx_hook where the policy compresses one of DDP's buckets, else
        # DDP's own allreduce (state None); the optimizer in the backward pass either way.
        state = cgx2.ddp.compress(
            ddp,
            args.bits,
            args.bucket_size,
            args.layer_min_size,
            mesh=None if args.flat else "auto",
            error_feedback=args.error_feedback,
            rotation=None if args.rotation == "none" else args.rotation,
            **(in_backward if args.optimizer_in_backward else {}),
        )
    elif args.mode == "hook" and args.bits != 32 and args.hook == "cgx":
        state = CGXState(
            None,
            args.layer_min_size,
            {"bits": args.bits, "bucket_size": args.bucket_size},
            mesh=None if args.flat else "auto",
            error_feedback=args.error_feedback,
            rotation=None if args.rotation == "none" else args.rotation,
        )
        hook = cgx_hook
    elif args.mode == "hook" and args.bits != 32:  # a Global-QSGD hook, by its name
        state = GlobalQSGDState(group, bits=args.bits)
        hook = getattr(gq, f"{args.hook}_hook")
    compressed = args.mode == "compress" and args.bits != 32  # compress registered it all
    if not args.optimizer_in_backward:
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    else:  # AdamW steps each bucket in the hook as its gradient arrives: no opt.step()
        opt = None
        if hook is None and not compressed:  # DDP's own allreduce, through allreduce_hook
            ddp._register_fused_optim(torch.optim.AdamW, lr=args.lr)
        elif hook is not None:
            hook = optimizer_in_hook(hook, torch.optim.AdamW, {"lr": args.lr})
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    forward = torch.compile(ddp) if args.compile else ddp
    text = load_text(args.text_bytes)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    losses, times = [], []
    progress = Progress()  # rank 0 reports; a line rewritten in place only on a terminal
    counted = (group.bytes_sent, group.bytes_uncompressed) if args.mode == "backend" else None
    for step in range(args.steps):
        x, y = batch(text, args.batch_size, args.context, gen, device)
        t0 = time.perf_counter()
        ddp.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], torch.bfloat16, enabled=args.amp == "bf16"):
            loss = nn.functional.cross_entropy(forward(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        if opt is not None:
            opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        mean_loss = loss.detach().cpu()
        dist.all_reduce(mean_loss, group=log_group)
        losses.append(mean_loss.item() / world)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            line = f"step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  {times[-1] * 1e3:.0f} ms"
            progress(line)
    progress.close()
    sent = (None, None)
    # What the hook's state was made with (None: no CGX hook), as it reports it.
    cgx = {"rotation": None, "error_feedback": None}
    if isinstance(state, CGXState):
        cgx = {"rotation": state.rotation, "error_feedback": state.errors is not None}
    plain = args.steps * ring_bytes_sent(4 * sum(p.numel() for p in model.parameters()), world)
    if state is not None:  # Global-QSGD's state counts what it sent; plain DDP's ring, this:
        sent = (state.bytes_sent, getattr(state, "bytes_uncompressed", plain))
    elif compressed:  # DDP's own allreduce was kept
        sent = (plain, plain)
    if counted is not None:  # the cgx backend's own counters, over the training steps
        sent = (group.bytes_sent - counted[0], group.bytes_uncompressed - counted[1])
    # DDP's reducer must be gone, and every rank done, before the process group is destroyed.
    del ddp, forward, state, opt
    gc.collect()
    dist.barrier()
    n = min(10, len(losses))
    graphs_used = graphs.stats()
    return {
        "env": environment(torch.device(device), world),
        "args": vars(args),
        "bits": args.bits,
        "mode": args.mode,
        "world_size": world,
        "device": device,
        "steps": args.steps,
        "params": sum(p.numel() for p in model.parameters()),
        "first_loss": losses[0],
        "final_loss": sum(losses[-n:]) / n,
        "step_ms": 1e3 * sorted(times)[len(times) // 2],
        "bytes_sent": sent[0],
        "bytes_uncompressed": sent[1],
        **cgx,
        "losses": losses,
        # What replayed CUDA graphs (CGX2_CUDA_GRAPHS) did on this rank, over the whole run.
        "cuda_graphs": graphs_used if any(graphs_used.values()) else None,
    }


def train_compared(args: argparse.Namespace) -> dict:
    """:func:`train` of plain DDP (the same model, seed and batches, no hook), then of
    ``args``' compressed DDP, in the same processes: the result of the second, with the first's
    as ``"plain"`` and the ratio of their median step times as ``"speedup_vs_plain"``."""
    plain = train(argparse.Namespace(**{**vars(args), "bits": 32, "compare": False}))
    result = train(args)
    result["plain"] = {k: plain[k] for k in ("first_loss", "final_loss", "step_ms", "losses")}
    result["speedup_vs_plain"] = plain["step_ms"] / result["step_ms"]
    return result


def init_process_group(args: argparse.Namespace, **kwargs: int) -> None:
    """gloo/NCCL, or the ``cgx`` backend with the flags passed as CGX's variables."""
    if args.mode == "backend":
        os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = str(args.bits)
        os.environ["CGX_COMPRESSION_BUCKET_SIZE"] = str(args.bucket_size)
        dist.init_process_group("cgx", **kwargs)
    else:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", **kwargs)


def _graphs_said(counts: dict[str, int] | None) -> str:
    if counts is None:
        return ""
    return (
        f"; CUDA graphs: {counts['captures']} captured, {counts['replays']} replays, "
        f"{counts['eager']} calls eager"
    )


def report(result: dict, json_path: str | None) -> None:
    sent, plain = result["bytes_sent"], result["bytes_uncompressed"]
    saved = (
        f", sent {sent / 1e6:.2f} MB vs {plain / 1e6:.2f} MB uncompressed "
        f"({plain / max(sent, 1):.2f}x less)"
        if sent
        else ""
    )
    print(
        f"{result['bits']}-bit DDP ({result['mode']}), {result['world_size']} x "
        f"{result['device']}, "
        f"{result['params'] / 1e6:.2f}M params: loss {result['first_loss']:.3f} -> "
        f"{result['final_loss']:.3f} (mean of the last steps), "
        f"{result['step_ms']:.0f} ms/step{saved}"
        f"{_graphs_said(result['cuda_graphs'])}"
    )
    plain = result.get("plain")
    if plain is not None:
        ratio = result["speedup_vs_plain"]
        said = f"{ratio:.2f}x as fast" if ratio >= 1 else f"{1 / ratio:.2f}x as slow"
        print(
            f"plain DDP, same seed and batches: loss {plain['first_loss']:.3f} -> "
            f"{plain['final_loss']:.3f}, {plain['step_ms']:.0f} ms/step; "
            f"{result['bits']}-bit DDP was {said} (median step, plain ms / cgx2 ms = {ratio:.2f})"
        )
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))


HOOKS = (
    "cgx",
    "standard_dithering",
    "standard_dithering_4bit",
    "thc",
    "qsgd",
    "exponential_dithering",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--bits", type=int, default=4, help="1-8, or 32 for plain DDP")
    add_bucket_size_argument(p)
    p.add_argument(
        "--layer-min-size",
        type=int,
        default=1024,
        help="smaller layers are sent uncompressed (hook mode only)",
    )
    add_choice(
        p,
        "--mode",
        ("hook", "compress", "backend"),
        "cgx_hook on DDP; cgx2.ddp.compress (the hook where it pays); or plain DDP on the cgx "
        "backend",
    )
    add_choice(p, "--hook", HOOKS, "hook mode's hook: CGX's, or a Global-QSGD hook")
    add_choice(
        p,
        "--rotation",
        ("none", "hadamard", "hadamard-clipped"),
        "cgx hook: code each layer's randomized Hadamard rotation (docs/low-bits.md); clipped: "
        "over the middle of each bucket's range, rounded to nearest",
    )
    p.add_argument(
        "--error-feedback",
        action="store_true",
        help="cgx hook: add what quantization took from a step's gradient to the next",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model under DDP")
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="AdamW (the same arguments) steps each bucket in the hook as its gradient arrives, "
        "overlapping the backward pass and the communication; no step after it",
    )
    p.add_argument(
        "--flat",
        action="store_true",
        help="cgx hook across nodes: the flat allreduce, not the node mesh",
    )
    p.add_argument("--steps", type=int, default=200, help="training steps")
    add_model_options(p, batch_size=16, context=64, dim=128, layers=2, heads=4, lr=3e-3)
    add_run_options(p, text_bytes=2_000_000)
    add_choice(
        p,
        "--amp",
        ("none", "bf16"),
        "bf16 autocast (fp32 weights and gradients): a lighter step, as in "
        "most training today, where communication weighs more",
    )
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="log on rank 0 what cgx2 times and chooses at first use",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="train plain DDP first (same seed, batches and steps), then report the compressed "
        "run's median step time against it",
    )
    p.add_argument("--json", help="write the result (losses, bytes, timing) here")
    args = parse(p, argv)
    if args.compare and (args.mode == "backend" or args.bits == 32):
        p.error(
            "--compare times a hook against plain DDP on the same group: --mode hook or "
            "compress, bits 1-8"
        )
    if args.mode == "compress" and args.hook != "cgx":
        p.error(f"--mode compress registers CGX's hook where it pays, not --hook {args.hook}")
    if not (1 <= args.bits <= 8 or args.bits == 32):
        p.error("--bits must be in 1..8, or 32")
    if (args.rotation != "none" or args.error_feedback) and (
        args.mode == "backend" or args.hook != "cgx" or args.bits == 32
    ):
        p.error(
            "--rotation and --error-feedback are the cgx hook's: --mode hook or compress, bits 1-8"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = launch(train_compared if args.compare else train, args, init_process_group)
    if result is not None:
        report(result, args.json)


if __name__ == "__main__":
    main()
