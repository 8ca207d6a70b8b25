"""Convergence at length: one byte-level transformer trained from the same initialization on the
same data order once per compressor, its loss measured on held-out text that no step sees.
Writes one JSON per run as it ends (a rerun skips finished runs), then a table, a summary JSON
and two plots (held-out loss against the step, and against the bytes a rank sent). With
``--time-limit``, a run that would not finish in time stops at a held-out evaluation and leaves
a checkpoint (each rank's model, optimizer, schedule, data order, compressor and seed state),
from which a rerun resumes it: as if never stopped, but for the DDP hooks' rounding after the
resume (DDP lays out its buckets afresh, and the hooks draw their random bits by bucket):

    python examples/convergence.py --steps 300 --compressors plain,cgx4     # 2 CPU processes
    torchrun --nproc-per-node 4 examples/convergence.py --device cuda --backend gloo \\
        --dim 384 --layers 6 --heads 6 --steps 2000 --seeds 3       # 4 ranks sharing one GPU

The text is the Python standard library's source as shipped (its .py files, documentation in
docstrings and pydoc's topics included): every tenth file, in sorted order, is held out. The
learning rate warms up linearly, then follows a cosine to a tenth of its peak. ``--seeds N``
repeats plain DDP and CGX 4-bit with N seeds (their spread is the noise floor); the other
compressors run with the first seed, and ``--only-seed K`` runs seed K of any. Each run's
bits a value sent (metadata included) are :func:`bits_per_value`'s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import parse
from launch import launch
from train_ddp import CharTransformer, batch, train_step

import cgx2
import cgx2.fsdp
from cgx2.bench.report import HelpFormatter, Progress, add_choice, environment
from cgx2.collectives.fusion import ring_bytes_sent
from cgx2.ddp import CGXState, GlobalQSGDState, LGreCoState, PowerSGDState, cgx_hook, lgreco_hook
from cgx2.ddp import global_qsgd as gq


def _cgx(
    bits: int,
    error_feedback: bool = False,
    rotation: str | None = None,
    adaptive_bits: tuple[int, ...] | None = None,
    average_bits: float | None = None,
) -> tuple[Callable, Callable]:
    params = {"bits": bits, "bucket_size": 512}
    return cgx_hook, lambda g: CGXState(
        g,
        1024,
        params,
        error_feedback=error_feedback,
        rotation=rotation,
        adaptive_bits=adaptive_bits,
        average_bits=average_bits,
    )


# name: (what it is, DDP hook, state factory given the process group); "fsdp4" is FSDP2's
COMPRESSORS: dict[str, tuple[str, Callable | None, Callable | None]] = {
    "plain": ("plain DDP", gq.default_hook, lambda g: None),
    "cgx2": ("CGX 2-bit", *_cgx(2)),
    "cgx4": ("CGX 4-bit", *_cgx(4)),
    "cgx8": ("CGX 8-bit", *_cgx(8)),
    "cgx4-ef": ("CGX 4-bit, error feedback", *_cgx(4, True)),
    "cgx2-ef": ("CGX 2-bit, error feedback", *_cgx(2, True)),
    # Fewer bits at the same loss (issue 44): rotated buckets (blocks of 128), error feedback
    "cgx2-rot": ("CGX 2-bit, rotated", *_cgx(2, rotation="hadamard")),
    "cgx2-rot-ef": ("CGX 2-bit, rotated, error feedback", *_cgx(2, True, "hadamard")),
    "cgx3": ("CGX 3-bit", *_cgx(3)),
    "cgx3-rot": ("CGX 3-bit, rotated", *_cgx(3, rotation="hadamard")),
    "cgx3-ef": ("CGX 3-bit, error feedback", *_cgx(3, True)),
    "cgx3-rot-ef": ("CGX 3-bit, rotated, error feedback", *_cgx(3, True, "hadamard")),
    "cgx4-rot": ("CGX 4-bit, rotated", *_cgx(4, rotation="hadamard")),
    # Each bucket's rotated values coded over the middle of its range, rounded to nearest
    "cgx2-rotc": ("CGX 2-bit, rotated, clipped", *_cgx(2, rotation="hadamard-clipped")),
    "cgx3-rotc": ("CGX 3-bit, rotated, clipped", *_cgx(3, rotation="hadamard-clipped")),
    "cgx4-rotc": ("CGX 4-bit, rotated, clipped", *_cgx(4, rotation="hadamard-clipped")),
    # Mixed widths by measured error (docs/low-bits.md's rule): 3 bits' error in fewer bytes
    "cgx3a-rot": (
        "CGX 2/3/4/8-bit by layer error (3-bit budget), rotated",
        *_cgx(3, rotation="hadamard", adaptive_bits=(2, 3, 4, 8)),
    ),
    # The least layer error within a payload of 2.28 bits a value: with each bucket's scale
    # and offset (64 bits a 512), the layers sent exact and the exact first step, at most 2.5
    # bits a value over a whole run of the 19.3M model, whatever the plans
    "cgx2.5a-rot": (
        "CGX 2/3/4/8-bit by layer error within 2.28 payload bits a value, rotated",
        *_cgx(2, rotation="hadamard", adaptive_bits=(2, 3, 4, 8), average_bits=2.28),
    ),
    "sd8": ("standard dithering (int8)", gq.standard_dithering_hook, GlobalQSGDState),
    "sd4": ("standard dithering 4-bit", gq.standard_dithering_4bit_hook, GlobalQSGDState),
    "thc": ("THC", gq.thc_hook, GlobalQSGDState),
    "qsgd": ("QSGD", gq.qsgd_hook, GlobalQSGDState),
    "exp": ("exponential dithering", gq.exponential_dithering_hook, GlobalQSGDState),
    "powersgd": (
        "PowerSGD rank 4",
        gq.powerSGD_hook,
        lambda g: PowerSGDState(g, 4, start_powerSGD_iter=10),
    ),
    "lgreco": (
        "L-GreCo PowerSGD",
        lgreco_hook,
        lambda g: LGreCoState(g, 4, start_powerSGD_iter=10, replan_every=50),
    ),
    "fsdp4": ("FSDP2, 4-bit reduce-scatter", None, None),
}
SEEDED = ("plain", "cgx4")  # the ones --seeds repeats


def load_split(train_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's .py files as uint8 text: (train, held out), every tenth file
    (sorted by path) held out; at most ``train_bytes`` of training text."""
    root = Path(os.__file__).parent
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, held = bytearray(), bytearray()
    for i, path in enumerate(files):
        if i % 10 == 0:
            held += path.read_bytes()
        elif len(train) < train_bytes:
            train += path.read_bytes()
    train = train[:train_bytes]
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(held, dtype=torch.uint8)


def schedule(step: int, steps: int, warmup: int) -> float:
    """The learning rate's factor: linear warm-up, then a cosine to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def fingerprint(args: argparse.Namespace, world: int) -> str:
    """What makes two runs of one compressor and seed the same run."""
    keys = (
        "dim layers heads context batch_size steps warmup lr train_bytes eval_every eval_batches"
    ).split()
    what = {k: getattr(args, k) for k in keys} | {"world": world}
    if args.optimizer != "adamw":  # (runs from before the option: AdamW's, unmarked)
        what["optimizer"] = args.optimizer
    return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]


def _build(name: str, args: argparse.Namespace, device: str) -> tuple[nn.Module, object]:
    torch.manual_seed(args.seed)  # the same initialization for every compressor
    model = CharTransformer(args.context, args.dim, args.layers, args.heads).to(device)
    if name == "fsdp4":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model, cgx2.fsdp.compress(model, bits=4)
    _, hook, make_state = COMPRESSORS[name]
    ddp = DDP(model)
    state = make_state(dist.group.WORLD)
    ddp.register_comm_hook(state, hook)
    return ddp, state


def _bytes_sent(name: str, state: object, plain: int) -> int:
    if name == "plain":
        return plain
    if name == "fsdp4":
        return sum(c.bytes_sent for c in state)
    return state.bytes_sent  # every hook's state counts what its rank sent


def bits_per_value(run: dict) -> tuple[float | None, float | None]:
    """Bits a rank sent a gradient value, metadata included: ``32 x`` its bytes over what plain
    DDP's fp32 ring allreduce sends (``plain_bytes_per_step``, 2(W-1)/W x 4 bytes a value),
    over the whole run and over its last evaluation interval. A hook's ``bytes_sent`` counts
    every payload (each bucket's scale and offset, padding to whole buckets), the layers sent
    exact (biases, norms: 32 bits) and CGXState's first step, sent exact; the last interval
    leaves that step out. None where the compressor counts no bytes."""
    plain, evals = run.get("plain_bytes_per_step"), run.get("evals") or []
    if not plain or run.get("bytes_per_step") is None:
        return None, None
    whole = 32 * run["bytes_per_step"] / plain
    if len(evals) < 2 or evals[-2]["bytes_sent"] is None:
        return whole, None
    a, b = evals[-2], evals[-1]
    return whole, 32 * (b["bytes_sent"] - a["bytes_sent"]) / (plain * (b["step"] - a["step"]))


@torch.no_grad()
def held_out_loss(
    model: nn.Module, held: torch.Tensor, args: argparse.Namespace, device: str
) -> float:
    """Mean loss on ``--eval-batches`` fixed batches of held-out text (every rank the same)."""
    model.eval()
    gen = torch.Generator().manual_seed(12345)
    total = 0.0
    for _ in range(args.eval_batches):
        x, y = batch(held, args.batch_size, args.context, gen, device)
        total += nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item()
    model.train()
    return total / args.eval_batches


def run_one(
    name: str,
    seed: int,
    args: argparse.Namespace,
    device: str,
    data: tuple[torch.Tensor, torch.Tensor],
) -> dict | None:
    """Train ``name`` with ``seed`` (from its checkpoint, where one is left): its result, or
    None where ``--time-limit`` stopped it (its checkpoint saved)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train, held = data
    args.seed = seed
    cgx2.manual_seed(seed)
    model, state = _build(name, args, device)
    if args.optimizer == "sgd":  # no per-weight normalization: error feedback's usual setting
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, args.steps, args.warmup))
    gen = torch.Generator().manual_seed(seed * 1000 + rank)  # one data order per seed
    params = sum(p.numel() for p in model.parameters())
    plain_step = ring_bytes_sent(4 * params, world)
    losses, evals, times = [], [], []
    start, ckpt = 0, checkpoint_path(Path(args.out), name, seed, rank)
    if ckpt.exists():
        saved = torch.load(ckpt, map_location=device, weights_only=False)
        if saved["fingerprint"] != fingerprint(args, world):
            raise SystemExit(f"{ckpt} is a checkpoint of other settings: use another --out")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["schedule"])
        gen.set_state(saved["data_order"].cpu())  # a CPU generator; map_location moved it
        _load_compression_state(name, model, state, saved["compression"])
        cgx2.seeding.set_state(saved["seed_state"])
        start, losses, evals, times = saved["step"], saved["losses"], saved["evals"], saved["times"]
    progress = Progress() if rank == 0 else None
    interval_start = time.time()
    for step in range(start, args.steps):
        x, y = batch(train, args.batch_size, args.context, gen, device)
        seconds, loss = train_step(model, opt, x, y, args.log_group)
        sched.step()
        times.append(seconds)
        losses.append(loss)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            sent = _bytes_sent(name, state, plain_step * (step + 1))
            evals.append(
                {
                    "step": step + 1,
                    "loss": held_out_loss(model, held, args, device),
                    "bytes_sent": sent,
                }
            )
            if progress is not None:
                progress(
                    f"{name} seed {seed}: step {step + 1}/{args.steps}  train "
                    f"{losses[-1]:.4f}  held out {evals[-1]['loss']:.4f}"
                )
            now = time.time()
            interval_s, interval_start = now - interval_start, now
            if step + 1 < args.steps and _out_of_time(args, interval_s):
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save(
                    {
                        "fingerprint": fingerprint(args, world),
                        "step": step + 1,
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "schedule": sched.state_dict(),
                        "data_order": gen.get_state(),
                        "compression": _compression_state(name, model, state),
                        "seed_state": cgx2.seeding.get_state(),
                        "losses": losses,
                        "evals": evals,
                        "times": times,
                    },
                    ckpt,
                )
                if progress is not None:
                    progress.close()
                return None
    if progress is not None:
        progress.close()
    ckpt.unlink(missing_ok=True)
    final = evals[-1]["loss"]
    result = {
        "compressor": name,
        "what": COMPRESSORS[name][0],
        "seed": seed,
        "params": params,
        "fingerprint": fingerprint(args, world),
        "train_losses": losses,
        "evals": evals,
        "final_held_out_loss": final,
        "final_held_out_ppl": math.exp(final),
        "bytes_per_step": None
        if evals[-1]["bytes_sent"] is None
        else evals[-1]["bytes_sent"] / args.steps,
        "plain_bytes_per_step": plain_step,
        "step_ms": 1e3 * sorted(times)[len(times) // 2],
    }
    result["bits_per_value"], result["bits_per_value_late"] = bits_per_value(result)
    return result


def _run_path(out: Path, name: str, seed: int) -> Path:
    return out / f"run_{name}_seed{seed}.json"


def checkpoint_path(out: Path, name: str, seed: int, rank: int) -> Path:
    """Where rank ``rank`` keeps an unfinished run's state (removed when the run ends)."""
    return out / "checkpoints" / f"{name}_seed{seed}_rank{rank}.pt"


def _compression_state(name: str, model: nn.Module, state: object) -> object:
    if name == "fsdp4":
        return cgx2.fsdp.compression_state_dict(model)
    return None if state is None else state.state_dict()


def _load_compression_state(name: str, model: nn.Module, state: object, saved: object) -> None:
    if name == "fsdp4":
        cgx2.fsdp.load_compression_state_dict(model, saved)
    elif state is not None:
        state.load_state_dict(saved)


def _out_of_time(args: argparse.Namespace, interval_s: float) -> bool:
    """Whether another ``interval_s`` of training (and a checkpoint) would pass
    ``--time-limit``: rank 0's answer, so that every rank stops at the same step."""
    if not args.time_limit:
        return False
    late = torch.tensor([time.time() - args.started + 1.5 * interval_s > args.time_limit])
    dist.broadcast(late, 0, group=args.log_group)
    return bool(late.item())


def pending_runs(args: argparse.Namespace, world: int) -> list[tuple[str, int]]:
    """The (compressor, seed) runs not yet in ``--out``; SystemExit if a run there is of
    other settings."""
    out, done_as = Path(args.out), fingerprint(args, world)
    if args.only_seed is not None:  # asked for by name: any compressor's seed K
        todo = [(name, args.only_seed) for name in args.compressors]
    else:
        todo = [
            (name, seed)
            for name in args.compressors
            for seed in (range(args.seeds) if name in SEEDED else [0])
        ]
    pending = []
    for name, seed in todo:
        path = _run_path(out, name, seed)
        if not path.exists():
            pending.append((name, seed))
        elif json.loads(path.read_text()).get("fingerprint") != done_as:
            raise SystemExit(f"{path} is a run of other settings: use another --out")
    return pending


def run_all(args: argparse.Namespace) -> dict:
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    out = Path(args.out)
    args.log_group = dist.new_group(backend="gloo")
    pending = [None]
    if dist.get_rank() == 0:  # one decision for every rank
        out.mkdir(parents=True, exist_ok=True)
        pending[0] = pending_runs(args, dist.get_world_size())
    dist.broadcast_object_list(pending, src=0)
    data = load_split(args.train_bytes)
    for i, (name, seed) in enumerate(pending[0]):
        if dist.get_rank() == 0:
            print(f"[{i + 1}/{len(pending[0])}] {name}, seed {seed}", file=sys.stderr, flush=True)
        result = run_one(name, seed, args, device, data)
        if result is None:  # out of time: checkpointed, to be resumed by a rerun
            if dist.get_rank() == 0:
                print(
                    f"{name}, seed {seed}: stopped for --time-limit, its checkpoint in "
                    f"{checkpoint_path(out, name, seed, 0).parent}",
                    file=sys.stderr,
                )
            break
        if dist.get_rank() == 0:
            result["env"] = environment(torch.device(device), dist.get_world_size())
            _run_path(out, name, seed).write_text(json.dumps(result, indent=1))
    del args.log_group
    return {"env": environment(torch.device(device), dist.get_world_size()), "args": vars(args)}


def summarize(out: Path) -> dict:
    """Every finished run in ``out`` of these settings, and each compressor's final held-out
    loss against plain DDP's: against plain's mean over seeds, and paired with plain's run of
    the same seed (same initialization and data order); and plain's seed spread."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("run_*.json"))]
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["compressor"], []).append(r)

    def mean(rs: list[dict]) -> float:
        return sum(r["final_held_out_loss"] for r in rs) / len(rs)

    plain = by.get("plain")
    base = mean(plain) if plain else None
    finals = [r["final_held_out_loss"] for r in plain or []]
    spread = max(finals) - min(finals) if len(finals) > 1 else None  # one seed: no spread
    plain_by_seed = {r["seed"]: r["final_held_out_loss"] for r in plain or []}
    rows = []
    for name in [n for n in COMPRESSORS if n in by]:
        rs = by[name]
        loss = mean(rs)
        sent = [r["bytes_per_step"] for r in rs if r["bytes_per_step"] is not None]
        paired = [
            (r["final_held_out_loss"] - plain_by_seed[r["seed"]]) / plain_by_seed[r["seed"]]
            for r in rs
            if r["seed"] in plain_by_seed
        ]
        bits, late = bits_per_value(rs[0])  # (every seed sends the same bytes)
        rows.append(
            {
                "compressor": name,
                "what": COMPRESSORS[name][0],
                "seeds": len(rs),
                "held_out_loss": loss,
                "ppl": math.exp(loss),
                "vs_plain": None if base is None else (loss - base) / base,
                "vs_plain_same_seed": sum(paired) / len(paired) if paired else None,
                "mb_per_step": sent[0] / 1e6 if sent else None,
                "bits_per_value": bits,
                "bits_per_value_late": late,
                "step_ms": sum(r["step_ms"] for r in rs) / len(rs),
            }
        )
    return {"rows": rows, "plain_spread": spread, "plain_mean": base, "runs": runs}


def table(summary: dict) -> str:
    spread = summary["plain_spread"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.2f}%"

    lines = [
        "| compressor | seeds | held-out loss | perplexity | vs plain | vs plain, same seed "
        "| MB/step a rank | bits a value | step ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["rows"]:
        mb = "-" if r["mb_per_step"] is None else f"{r['mb_per_step']:.2f}"
        bits = "-" if r.get("bits_per_value") is None else f"{r['bits_per_value']:.2f}"
        paired = pct(r.get("vs_plain_same_seed"))
        lines.append(
            f"| {r['what']} | {r['seeds']} | {r['held_out_loss']:.4f} | "
            f"{r['ppl']:.3f} | {pct(r['vs_plain'])} | {paired} | {mb} | {bits} | "
            f"{r['step_ms']:.1f} |"
        )
    if spread is not None:
        lines.append(
            f"\nplain DDP's seed spread (max - min held-out loss): {spread:.4f} "
            f"({100 * spread / summary['plain_mean']:.2f}% of its mean)"
        )
    lines.append(
        "bits a value: 32 x the bytes a rank sent over plain DDP's fp32 ring allreduce, the "
        "whole run (scales, padding, exact layers and the exact first step included)"
    )
    return "\n".join(lines)


def plot(summary: dict, out: Path) -> list[Path]:
    """Held-out loss against step and against MB sent: a colour a compressor, a line style a
    seed; the right panel zooms on the second half, where the runs part."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["compressor"] for r in summary["rows"]]
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    styles = ("-", "--", ":", "-.")
    paths = []
    for x_key, label, name in (
        ("step", "step", "loss_by_step.png"),
        ("bytes_sent", "MB a rank sent", "loss_by_bytes.png"),
    ):
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for r in sorted(summary["runs"], key=lambda r: (names.index(r["compressor"]), r["seed"])):
            points = [(e[x_key], e["loss"]) for e in r["evals"] if e[x_key] is not None]
            if not points:
                continue
            xs = [p[0] / (1e6 if x_key == "bytes_sent" else 1) for p in points]
            late = len(points) // 2
            for ax, first in ((axes[0], 0), (axes[1], late)):
                ax.plot(
                    xs[first:],
                    [p[1] for p in points[first:]],
                    linewidth=1.2,
                    color=colours[r["compressor"]],
                    linestyle=styles[r["seed"] % 4],
                    label=f"{r['what']} (seed {r['seed']})",
                )
        for ax in axes:
            if x_key == "bytes_sent":
                ax.set_xscale("log")
            ax.set(xlabel=label, ylabel="held-out loss")
            ax.grid(alpha=0.3)
        axes[0].set_title("whole run")
        axes[1].set_title("second half")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def init_group(args: argparse.Namespace, **kwargs: int) -> None:
    """NCCL for --device cuda unless --backend gloo (ranks sharing one GPU); gloo on CPUs."""
    dist.init_process_group(
        "nccl" if args.device == "cuda" and args.backend == "nccl" else "gloo", **kwargs
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--compressors",
        default=",".join(COMPRESSORS),
        help=f"comma-separated, of: {', '.join(COMPRESSORS)}",
    )
    p.add_argument("--seeds", type=int, default=1, help="seeds of plain DDP and CGX 4-bit")
    p.add_argument(
        "--only-seed",
        type=int,
        metavar="K",
        help="run only seed K, of any compressor (several processes sharing a study; "
        "more seeds of the best low-bit one)",
    )
    p.add_argument("--steps", type=int, default=2000, help="training steps a run")
    p.add_argument("--warmup", type=int, default=100, help="steps of linear warm-up")
    p.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate")
    add_choice(
        p, "--optimizer", ("adamw", "sgd"), "AdamW (weight decay 0.1) or SGD with momentum 0.9"
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences a rank and step")
    p.add_argument("--context", type=int, default=256, help="tokens (bytes) a sequence")
    p.add_argument("--dim", type=int, default=384, help="model width")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks")
    p.add_argument("--heads", type=int, default=6, help="attention heads")
    p.add_argument("--train-bytes", type=int, default=20_000_000, help="bytes of training text")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out losses")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches an evaluation")
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn without torchrun")
    p.add_argument(
        "--time-limit",
        type=float,
        default=0,
        metavar="SECONDS",
        help="stop a run that would not finish within this many seconds of the "
        "start at a held-out evaluation, checkpointed; a rerun resumes it "
        "(0: no limit)",
    )
    add_choice(p, "--device", ("auto", "cpu", "cuda"), "auto: cuda if available")
    add_choice(p, "--backend", ("nccl", "gloo"), "for --device cuda: gloo lets ranks share one GPU")
    p.add_argument(
        "--out",
        default="cgx2-results/convergence",
        help="the runs' folder: finished runs there are skipped",
    )
    args = parse(p, argv)
    args.compressors = args.compressors.split(",")
    args.started = time.time()  # --time-limit counts from here (rank 0's, under torchrun)
    unknown = [c for c in args.compressors if c not in COMPRESSORS]
    if unknown:
        p.error(f"--compressors: unknown {unknown}; choose from {', '.join(COMPRESSORS)}")
    if args.seeds < 1 or args.steps < 1 or args.eval_every < 1 or args.warmup < 0:
        p.error("--seeds, --steps and --eval-every must be at least 1, --warmup at least 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", args.world_size))
    # Nothing left to train (or a folder of other settings): no processes to start.
    if pending_runs(args, world):
        if launch(run_all, args, init_group) is None:
            return  # not rank 0
    elif int(os.environ.get("RANK", 0)) != 0:
        return
    out = Path(args.out)
    summary = summarize(out)
    print(table(summary))
    kept = {k: v for k, v in summary.items() if k != "runs"} | {"args": vars(args)}
    (out / "summary.json").write_text(json.dumps(kept, indent=1))
    plots = plot(summary, out)
    print(f"runs and summary: {out}/; plots: {', '.join(str(p) for p in plots)}")


if __name__ == "__main__":
    main()
