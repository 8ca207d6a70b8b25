"""Train the byte-level transformer of train_ddp.py with every DDP hook cgx2 offers, from the
same seed on the same data, and compare: final loss, bytes sent, step time, and a plot of the
loss against the step (PNG). Writes the table, the JSON and the plot:

    python examples/compare_hooks.py --steps 100                       # 2 CPU processes
    torchrun --nproc-per-node 4 examples/compare_hooks.py --steps 300  # one process per GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import add_model_options, add_run_options, parse
from launch import launch
from train_ddp import CharTransformer, batch, load_text, train_step

import cgx2
from cgx2.bench.report import HelpFormatter, environment
from cgx2.ddp import CGXState, GlobalQSGDState, LGreCoState, PowerSGDState, cgx_hook, lgreco_hook
from cgx2.ddp import global_qsgd as gq

# name: (hook, state factory); the factory gets the process group
HOOKS = {
    "plain (default_hook)": (gq.default_hook, lambda g: None),
    "cgx 4-bit": (cgx_hook, lambda g: CGXState(g, 1024, {"bits": 4, "bucket_size": 512})),
    "cgx 2-bit": (cgx_hook, lambda g: CGXState(g, 1024, {"bits": 2, "bucket_size": 512})),
    "standard dithering (int8)": (gq.standard_dithering_hook, GlobalQSGDState),
    "standard dithering 4-bit": (gq.standard_dithering_4bit_hook, GlobalQSGDState),
    "THC": (gq.thc_hook, GlobalQSGDState),
    "QSGD": (gq.qsgd_hook, GlobalQSGDState),
    "exponential dithering": (gq.exponential_dithering_hook, GlobalQSGDState),
    "PowerSGD rank 4": (gq.powerSGD_hook, lambda g: PowerSGDState(g, 4, start_powerSGD_iter=2)),
    # per-layer ranks 1-8 at rank 4's error (L-GreCo), re-planned every 20 steps
    "L-GreCo PowerSGD": (
        lgreco_hook,
        lambda g: LGreCoState(g, 4, start_powerSGD_iter=2, replan_every=20),
    ),
}


def run_one(name: str, args: argparse.Namespace, device: str, text: torch.Tensor) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    hook, make_state = HOOKS[name]
    torch.manual_seed(args.seed)
    cgx2.manual_seed(args.seed)
    model = DDP(CharTransformer(args.context, args.dim, args.layers, args.heads).to(device))
    state = make_state(dist.group.WORLD)
    model.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses, times = [], []
    for _ in range(args.steps):
        x, y = batch(text, args.batch_size, args.context, gen, device)
        seconds, loss = train_step(model, opt, x, y, args.log_group)
        times.append(seconds)
        losses.append(loss)
    n = min(10, len(losses))
    params = sum(p.numel() for p in model.parameters())
    # plain DDP: a ring allreduce of every fp32 gradient, every step
    plain = args.steps * 2 * (world - 1) * params * 4 // world
    sent = plain if hook is gq.default_hook else getattr(state, "bytes_sent", None)
    return {
        "hook": name,
        "losses": losses,
        "final_loss": sum(losses[-n:]) / n,
        "step_ms": 1e3 * sorted(times)[len(times) // 2],
        "bytes_sent": sent,  # None: not counted (PowerSGD)
        "bytes_plain": plain,
    }


def run_all(args: argparse.Namespace) -> dict:
    world = dist.get_world_size()
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    args.log_group = dist.new_group(backend="gloo")
    text = load_text(args.text_bytes)
    runs = []
    for i, name in enumerate(HOOKS):
        if dist.get_rank() == 0:
            print(f"[{i + 1}/{len(HOOKS)}] {name}", file=sys.stderr, flush=True)
        runs.append(run_one(name, args, device, text))
    del args.log_group
    return {"env": environment(torch.device(device), world), "args": vars(args), "runs": runs}


def table(report: dict) -> str:
    lines = [
        "| hook | final loss | bytes sent (MB) | vs plain DDP | step ms |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in report["runs"]:
        sent = r["bytes_sent"]
        size = "-" if sent is None else f"{sent / 1e6:.1f}"
        ratio = "-" if not sent else f"{r['bytes_plain'] / sent:.2f}× less"
        lines.append(
            f"| {r['hook']} | {r['final_loss']:.4f} | {size} | {ratio} | {r['step_ms']:.1f} |"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in report["runs"]:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["hook"], linewidth=1)
    env = report["env"]
    ax.set(
        xlabel="step",
        ylabel="training loss (mean over ranks)",
        title=f"DDP hooks, {env['world_size']} x {env['device']}",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(report: dict, out_dir: str) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    env = report["env"]
    stem = (
        Path(out_dir) / f"compare_hooks_{env['device'].lower().replace(' ', '-')}_"
        f"w{env['world_size']}_{stamp}"
    )
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, stem.with_suffix(".png"))
    return stem


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="training steps per hook")
    add_model_options(p, batch_size=16, context=64, dim=128, layers=2, heads=4, lr=3e-3)
    add_run_options(p, text_bytes=2_000_000)
    p.add_argument(
        "--out-dir", default="cgx2-results", help="where the JSON and PNG go, created if missing"
    )
    return parse(p, argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = launch(run_all, args)
    if report is None:
        return
    print(table(report))
    stem = write(report, args.out_dir)
    print(f"raw results: {stem}.json, plot: {stem}.png")


if __name__ == "__main__":
    main()
