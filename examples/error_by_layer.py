"""Where the quantization error of a DDP step lies, layer by layer: the convergence study's model
(examples/convergence.py) trained plainly, and at chosen steps its gradients on ``--ranks``
batches (one a rank) allreduced at each width, layer by layer as CGX's hook compresses them, by
cgx2's reference model of the collective, against their exact mean:

    python examples/error_by_layer.py --dim 64 --layers 2 --heads 2 --steps 20 --at 0,20
    python examples/error_by_layer.py --device cuda --dim 512 --layers 6 --heads 8 \\
        --steps 2000 --at 0,500,2000                                   # the study's model

One process stands for the ranks: the training step's batch is theirs together. Per kind of
layer (the blocks' alike together): its values, its share of the mean gradient's squared norm,
the relative error ||allreduced - mean|| / ||mean|| at each width beside the mean's own
sampling noise, and its share of the step's squared error at the narrowest. ``--rotation``
measures each width plain, rotated (randomized Hadamard, blocks of ``--rotation-block``, as
``CGXState(rotation="hadamard")`` sends it) or both (the default; rotated columns "...-bit
rot"); each step's line under its table gives the whole gradient's error-to-noise ratio
(relative error over batch noise) at each. Layers the hook sends exact (biases, norms, fewer
than ``--layer-min-size`` values) have none. A table per step, and a JSON of all of them.

``--compressors NAME,...|all`` measures the convergence study's DDP compressors (its
``COMPRESSORS``: their hooks and states, fsdp4 aside) through DDP itself, in ``--ranks``
processes (torchrun's, or spawned gloo ones): at each step each rank's batch gradient, then per
compressor a copy of the model in DDP with its hook, ``--hook-warmup`` backward passes at the
same weights on other batches (error feedback's residuals, PowerSGD's start and warm start,
adaptive plans reach their steady state; CGX's first pass is exact and DDP rebuilds its
buckets after it), and a last one on the rank's batch: the gradient DDP leaves in ``.grad``
against the ranks' exact mean, its relative error and error-to-noise ratio, a table a step:

    torchrun --nproc-per-node 4 examples/error_by_layer.py --ranks 4 --compressors all \\
        --dim 512 --layers 6 --heads 8 --context 64 --steps 0 --at 0
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import COMPRESSORS, load_split, schedule
from launch import launch
from train_ddp import CharTransformer, batch

import cgx2
from cgx2.bench import report
from cgx2.collectives import reference_allreduce
from cgx2.collectives.fusion import ring_bytes_sent
from cgx2.collectives.rotations import check_rotation


def kind(name: str) -> str:
    """A parameter's kind: its name with the block's index starred."""
    return re.sub(r"blocks\.\d+\.", "blocks.*.", name)


def batches(
    train: torch.Tensor, args: argparse.Namespace, gen: torch.Generator, device: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch for each rank, in rank order; every process draws them all, so that a rank's
    batch is the one a single process would give it."""
    return [batch(train, args.batch_size, args.context, gen, device) for _ in range(args.ranks)]


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss on ``(x, y)``, its gradient left in ``.grad`` (afresh)."""
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    return loss.detach()


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s gradient, by parameter name."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def gradients(
    model: nn.Module, drawn: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """Each rank's gradient (on its batch of ``drawn``), by parameter name."""
    per_rank = []
    for x, y in drawn:
        backward(model, x, y)
        per_rank.append(grads_of(model))
    model.zero_grad(set_to_none=True)
    return per_rank


def spread(grads: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """The ranks' mean gradient and its squared standard error, from the ranks' spread: the
    noise SGD's batches bring before anything is quantized."""
    w = len(grads)
    mean = sum(grads) / w
    return mean, float(sum((g - mean).square().sum() for g in grads)) / (w * (w - 1))


def errors(
    model: nn.Module,
    per_rank: list[dict[str, torch.Tensor]],
    args: argparse.Namespace,
    seed: int,
    averaged: dict[str, dict[str, torch.Tensor]] | None = None,
) -> list[dict]:
    """Per kind of layer: values, squared norm of the mean gradient, squared error per width
    and rotation (keys as :func:`columns`') and of each of ``averaged`` (a compressor's
    allreduced gradient by parameter name: keyed by the compressor's name)."""
    kinds: dict[str, dict] = {}
    for name, p in model.named_parameters():
        grads = [g[name].float().cpu() for g in per_rank]
        mean, noise2 = spread(grads)
        row = kinds.setdefault(
            kind(name),
            {
                "layer": kind(name),
                "values": 0,
                "norm2": 0.0,
                "noise2": 0.0,
                "compressed": False,
                "err2": {},
            },
        )
        row["values"] += p.numel()
        row["norm2"] += float(mean.square().sum())
        row["noise2"] += noise2
        for key, got in (averaged or {}).items():
            err2 = float((got[name].float().cpu() - mean).square().sum())
            row["err2"][key] = row["err2"].get(key, 0.0) + err2
        if p.dim() > 1 and p.numel() >= args.layer_min_size:
            row["compressed"] = True
            for key, bits, rotation in columns(args):
                got = reference_allreduce(
                    grads,
                    bits,
                    args.bucket_size,
                    seed,
                    "avg",
                    rotation=rotation,
                    rotation_block=args.rotation_block,
                )
                row["err2"][key] = row["err2"].get(key, 0.0) + float((got - mean).square().sum())
    return list(kinds.values())


def columns(args: argparse.Namespace) -> list[tuple[str, int, str | None]]:
    """The measured (key, bits, rotation): "2" for 2 bits plain, "2_rot" rotated; the first is
    the narrowest width of the first rotation asked for."""
    return [
        (f"{b}{'' if rotation is None else '_rot'}", b, rotation)
        for rotation in args.rotations
        for b in args.bits
    ]


def rows_of(kinds: list[dict], keys: list[str]) -> list[dict]:
    """The table's rows: shares, relative errors (``rel_err_<key>``) and the error-to-noise
    ratios (``err_to_noise_<key>``: the relative error over the batch noise)."""
    norm2 = sum(k["norm2"] for k in kinds)
    narrowest = keys[0]
    err2 = sum(k["err2"].get(narrowest, 0.0) for k in kinds)
    rows = []
    for k in sorted(kinds, key=lambda k: -k["err2"].get(narrowest, 0.0)):
        row = {
            "layer": k["layer"],
            "values": k["values"],
            "grad_share": k["norm2"] / norm2,
            "error_share": k["err2"].get(narrowest, 0.0) / err2 if err2 else 0.0,
            "compressed": k["compressed"],
            "batch_noise": (k["noise2"] / k["norm2"]) ** 0.5,
        }
        for key in keys:
            e = k["err2"].get(key)
            row[f"rel_err_{key}"] = None if e is None else (e / k["norm2"]) ** 0.5
            noise = row["batch_noise"]
            row[f"err_to_noise_{key}"] = (
                None if e is None or not noise else row[f"rel_err_{key}"] / noise
            )
        rows.append(row)
    whole = {
        "layer": "the whole gradient",
        "values": sum(k["values"] for k in kinds),
        "grad_share": 1.0,
        "error_share": 1.0 if err2 else 0.0,
        "compressed": None,
        "batch_noise": (sum(k["noise2"] for k in kinds) / norm2) ** 0.5,
    }
    for key in keys:
        whole[f"rel_err_{key}"] = (sum(k["err2"].get(key, 0.0) for k in kinds) / norm2) ** 0.5
        whole[f"err_to_noise_{key}"] = whole[f"rel_err_{key}"] / whole["batch_noise"]
    return [*rows, whole]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    parts = flat.split([t.numel() for t in like])
    return [part.view_as(t) for part, t in zip(parts, like, strict=True)]


def gathered(grads: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's ``grads``, in rank order, on rank 0 (None on the others)."""
    flat = _flat(list(grads.values()))
    if dist.get_rank() != 0:
        dist.gather(flat, None, dst=0)
        return None
    bins = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.gather(flat, bins, dst=0)
    return [dict(zip(grads, _unflat(b, list(grads.values())), strict=True)) for b in bins]


def average_(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """Plain data parallelism's step: the ranks' gradients (in ``.grad``) and losses averaged
    exactly; the mean loss."""
    grads = [p.grad for p in model.parameters()]
    flat = _flat([*grads, loss])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, mean in zip(grads, _unflat(flat[:-1], grads), strict=True):
        g.copy_(mean)
    return flat[-1]


def through_hook(
    name: str,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    warm: list[tuple[torch.Tensor, torch.Tensor]],
    seed: int,
) -> tuple[dict[str, torch.Tensor], float]:
    """The gradient DDP leaves in ``.grad`` on ``(x, y)`` with the study's compressor ``name``
    (a copy of ``model`` in DDP, with its hook and state), after a backward pass on each of
    ``warm`` at the same weights; and the bits a value this rank sent in that last pass."""
    _, hook, make_state = COMPRESSORS[name]
    cgx2.manual_seed(seed)  # each compressor's rounding as the study's run of this seed draws it
    ddp = DDP(copy.deepcopy(model))
    state = make_state(dist.group.WORLD)
    ddp.register_comm_hook(state, hook)
    for wx, wy in warm:
        backward(ddp, wx, wy)
    before = 0 if state is None else state.bytes_sent
    backward(ddp, x, y)
    values = sum(p.numel() for p in model.parameters())
    plain = ring_bytes_sent(4 * values, dist.get_world_size())  # fp32's ring allreduce
    bits = 32.0 if state is None else 32 * (state.bytes_sent - before) / plain
    return grads_of(ddp.module), bits


HOOKED = [name for name, (_, hook, _) in COMPRESSORS.items() if hook is not None]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=report.HelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="ranks the batches stand for")
    p.add_argument("--bits", default="2,3,4,8", help="comma-separated widths")
    p.add_argument(
        "--rotation",
        choices=("none", "hadamard", "both"),
        default="both",
        help="each width as sent plain, rotated (CGXState(rotation='hadamard')), or both",
    )
    p.add_argument("--rotation-block", type=int, default=128, help="the rotation's block")
    p.add_argument("--steps", type=int, default=2000, help="plain training steps in all")
    p.add_argument("--at", default="0,500,2000", help="steps after which to measure")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16, help="sequences a rank")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--train-bytes", type=int, default=20_000_000)
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument(
        "--layer-min-size",
        type=int,
        default=1024,
        help="smaller layers are sent exact, as CGXState's",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--compressors",
        default="",
        help="comma-separated, or all: the convergence study's DDP compressors to measure "
        f"through their hooks, in --ranks processes ({', '.join(HOOKED)})",
    )
    p.add_argument(
        "--hook-warmup",
        type=int,
        default=12,
        help="backward passes each compressor makes at the step's weights, on other batches, "
        "before the measured one (past PowerSGD's start_powerSGD_iter=10 and CGX's exact "
        "first step)",
    )
    report.add_out_argument(p)
    args = p.parse_args(argv)
    names = [n for n in args.compressors.split(",") if n]
    args.compressors = HOOKED if names == ["all"] else names
    unknown = [n for n in args.compressors if n not in HOOKED]
    if unknown:
        p.error(f"--compressors: {unknown} not DDP compressors of the study's ({HOOKED})")
    if args.hook_warmup < 0:
        p.error("--hook-warmup must be at least 0")
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and not args.compressors:
        p.error("one process measures the widths alone: launch it without torchrun")
    if launched is not None and int(launched) != args.ranks:
        p.error(f"--ranks {args.ranks}, but torchrun started {launched} processes")
    args.world_size = args.ranks  # the processes launch() spawns without torchrun
    args.bits = sorted({int(b) for b in args.bits.split(",")})
    args.at = sorted({int(s) for s in args.at.split(",")})
    try:
        check_rotation("hadamard", args.rotation_block, args.bucket_size, "", "--rotation-block")
    except ValueError as e:
        p.error(str(e))
    args.rotations = {"none": [None], "hadamard": ["hadamard"], "both": [None, "hadamard"]}[
        args.rotation
    ]
    if args.ranks < 2 or any(not 1 <= b <= 8 for b in args.bits):
        p.error("--ranks must be at least 2 and --bits between 1 and 8")
    if any(not 0 <= s <= args.steps for s in args.at):
        p.error("--at: steps between 0 and --steps")
    return args


def measure(args: argparse.Namespace) -> dict:
    """The plain training, measured at each step of ``--at``: the result, whole on rank 0.
    In processes (``--compressors``) each trains on its share of the step's batch, the
    gradients averaged exactly: the one process's training, but for rounding."""
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu"
    torch.manual_seed(args.seed)  # the study's initialization for this seed
    model = CharTransformer(args.context, args.dim, args.layers, args.heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, args.steps, args.warmup))
    train, _ = load_split(args.train_bytes)
    gen = torch.Generator().manual_seed(args.seed)
    measured_gen = torch.Generator().manual_seed(args.seed + 1)  # the measured batches
    progress = report.Progress()
    say = progress if rank == 0 else lambda line: None
    keys = [key for key, _, _ in columns(args)]
    measured = []
    for step in range(args.steps + 1):
        if step in args.at:
            say(f"step {step}: the error of each layer at {args.bits} bits")
            drawn = batches(train, args, measured_gen, device)
            if distributed:
                backward(model, *drawn[rank])
                per_rank = gathered(grads_of(model))
                model.zero_grad(set_to_none=True)
            else:
                per_rank = gradients(model, drawn)
            # The warm-up's batches: others than the measured, the same for every compressor.
            warm_gen = torch.Generator().manual_seed(args.seed + 2 + step)
            warm = [batches(train, args, warm_gen, device)[rank] for _ in range(args.hook_warmup)]
            averaged, bits, seconds = {}, {}, {}
            for i, name in enumerate(args.compressors):
                say(f"step {step}: {name} ({i + 1}/{len(args.compressors)}) through DDP")
                start = time.perf_counter()
                got, bits[name] = through_hook(name, model, *drawn[rank], warm, args.seed)
                seconds[name] = time.perf_counter() - start
                if rank == 0:  # DDP leaves every rank the same average
                    averaged[name] = got
            if rank == 0:
                kinds = errors(model, per_rank, args, step, averaged)
                rows = rows_of(kinds, [*keys, *args.compressors])
                measured.append({"step": step, "rows": rows})
                if args.compressors:
                    measured[-1]["hook_warmup"] = args.hook_warmup
                    measured[-1]["compressors"] = [
                        {
                            "compressor": name,
                            "what": COMPRESSORS[name][0],
                            "rel_err": rows[-1][f"rel_err_{name}"],
                            "err_to_noise": rows[-1][f"err_to_noise_{name}"],
                            "bits_per_value": bits[name],
                            "seconds": seconds[name],
                        }
                        for name in args.compressors
                    ]
        if step == args.steps:
            break
        x, y = batch(train, args.ranks * args.batch_size, args.context, gen, device)
        if distributed:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = backward(model, x, y)
        if distributed:
            loss = average_(model, loss)
        opt.step()
        sched.step()
        if (step + 1) % 100 == 0:
            say(f"step {step + 1}/{args.steps}: train loss {loss.item():.4f}")
    progress.close()
    env = report.environment(torch.device(device), args.ranks)
    return {"env": env, "args": vars(args), "measured": measured}


def main(argv: list[str] | None = None) -> dict | None:
    """Measure, print the tables and write the JSON: the result (None on ranks other than
    0)."""
    args = parse_args(argv)
    result = launch(measure, args) if args.compressors else measure(args)
    if result is None:
        return None
    keys = [key for key, _, _ in columns(args)]
    measured = result["measured"]

    def title(key: str) -> str:
        return f"{key.removesuffix('_rot')}-bit{' rot' if key.endswith('_rot') else ''}"

    narrowest = title(keys[0])
    table = [
        ("layer", "layer", ""),
        ("values", "values", ","),
        ("grad_share", "grad share", ".1%"),
        ("error_share", f"{narrowest} error share", ".1%"),
    ]
    table += [("batch_noise", "batch noise", ".3f")]
    table += [(f"rel_err_{key}", f"rel. err {title(key)}", ".3f") for key in keys]
    hooked = [
        ("compressor", "compressor", ""),
        ("what", "what it is", ""),
        ("rel_err", "rel. err", ".4f"),
        ("err_to_noise", "error-to-noise", ".3f"),
        ("bits_per_value", "bits a value", ".2f"),
    ]
    for m in measured:
        print(f"\nafter {m['step']} steps:")
        print(report.format_table(m["rows"], table))
        whole = m["rows"][-1]
        ratios = ", ".join(f"{title(k)} {whole[f'err_to_noise_{k}']:.2f}" for k in keys)
        print(f"error-to-noise ratio, the whole gradient: {ratios}")
        if "compressors" in m:
            print(
                f"\nafter {m['step']} steps, the whole gradient through each compressor's DDP "
                f"hook ({args.ranks} ranks, {m['hook_warmup']} warm-up passes first; batch "
                f"noise {whole['batch_noise']:.4f}):"
            )
            print(report.format_table(m["compressors"], hooked))
    legend = [
        ("grad share", "the layer's share of the mean gradient's squared norm"),
        ("error share", f"its share of the {narrowest} allreduce's squared error"),
        (
            "batch noise",
            "the mean gradient's standard error from the ranks' spread, / ||mean||: "
            "the noise of SGD's batches, for scale",
        ),
        ("rel. err", "||allreduced - mean|| / ||mean|| over the layer (- : sent exact)"),
        ("rot", "the width's randomized Hadamard rotation (--rotation-block values)"),
        ("error-to-noise", "rel. err / batch noise (the JSON has it for every row)"),
    ]
    if args.compressors:
        legend += [
            (
                "compressor",
                "the convergence study's, its hook and state on a copy of the model in DDP: "
                "the gradient DDP leaves in .grad against the ranks' exact mean, after "
                f"--hook-warmup {args.hook_warmup} backward passes at the same weights on "
                "other batches (JSON rows: rel_err_<compressor>, by layer)",
            ),
            (
                "bits a value",
                "32 x the bytes a rank sent in the measured pass over fp32's ring allreduce",
            ),
        ]
    print(report.format_legend(legend))
    path = report.write_json("error_by_layer", result, args.out)
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
