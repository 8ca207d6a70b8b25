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
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import load_split, schedule
from train_ddp import CharTransformer, batch

from cgx2.bench import report
from cgx2.collectives import reference_allreduce
from cgx2.collectives.rotations import check_rotation


def kind(name: str) -> str:
    """A parameter's kind: its name with the block's index starred."""
    return re.sub(r"blocks\.\d+\.", "blocks.*.", name)


def gradients(
    model: nn.Module,
    train: torch.Tensor,
    args: argparse.Namespace,
    gen: torch.Generator,
    device: str,
) -> list[dict[str, torch.Tensor]]:
    """Each rank's gradient (a batch of its own), by parameter name."""
    per_rank = []
    for _ in range(args.ranks):
        model.zero_grad(set_to_none=True)
        x, y = batch(train, args.batch_size, args.context, gen, device)
        nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
        per_rank.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return per_rank


def errors(
    model: nn.Module, per_rank: list[dict[str, torch.Tensor]], args: argparse.Namespace, seed: int
) -> list[dict]:
    """Per kind of layer: values, squared norm of the mean gradient, squared error per width
    and rotation (keys as :func:`columns`')."""
    kinds: dict[str, dict] = {}
    for name, p in model.named_parameters():
        grads = [g[name].float().cpu() for g in per_rank]
        mean = sum(grads) / len(grads)
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
        # The mean's own sampling error (its squared standard error, from the ranks' spread):
        # the noise SGD's batches bring before anything is quantized.
        w = len(grads)
        row["noise2"] += float(sum((g - mean).square().sum() for g in grads)) / (w * (w - 1))
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
    report.add_out_argument(p)
    args = p.parse_args(argv)
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


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = args.device
    torch.manual_seed(args.seed)  # the study's initialization for this seed
    model = CharTransformer(args.context, args.dim, args.layers, args.heads).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, args.steps, args.warmup))
    train, _ = load_split(args.train_bytes)
    gen = torch.Generator().manual_seed(args.seed)
    measured_gen = torch.Generator().manual_seed(args.seed + 1)  # the measured batches
    progress = report.Progress()
    keys = [key for key, _, _ in columns(args)]
    measured = []
    for step in range(args.steps + 1):
        if step in args.at:
            progress(f"step {step}: the error of each layer at {args.bits} bits")
            kinds = errors(model, gradients(model, train, args, measured_gen, device), args, step)
            measured.append({"step": step, "rows": rows_of(kinds, keys)})
        if step == args.steps:
            break
        opt.zero_grad(set_to_none=True)
        x, y = batch(train, args.ranks * args.batch_size, args.context, gen, device)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 100 == 0:
            progress(f"step {step + 1}/{args.steps}: train loss {loss.item():.4f}")
    progress.close()

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
    for m in measured:
        print(f"\nafter {m['step']} steps:")
        print(report.format_table(m["rows"], table))
        whole = m["rows"][-1]
        ratios = ", ".join(f"{title(k)} {whole[f'err_to_noise_{k}']:.2f}" for k in keys)
        print(f"error-to-noise ratio, the whole gradient: {ratios}")
    print(
        report.format_legend(
            [
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
        )
    )
    env = report.environment(torch.device(device), args.ranks)
    result = {"env": env, "args": vars(args), "measured": measured}
    path = report.write_json("error_by_layer", result, args.out)
    print(f"-> {path}")
    return result


if __name__ == "__main__":
    main()
