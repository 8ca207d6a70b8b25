"""The examples' shared command-line options: the character transformer's shape and training
settings, and where a run goes (text, processes, device)."""

from __future__ import annotations

import argparse

import torch

from cgx2.bench.report import add_choice


def add_model_options(
    p: argparse.ArgumentParser,
    *,
    batch_size: int,
    context: int,
    dim: int,
    layers: int,
    heads: int,
    lr: float,
) -> None:
    """--batch-size, --context, --dim, --layers, --heads, --lr and --seed, with these defaults."""
    p.add_argument("--batch-size", type=int, default=batch_size, help="sequences per rank and step")
    p.add_argument("--context", type=int, default=context, help="tokens (bytes) per sequence")
    p.add_argument("--dim", type=int, default=dim, help="model width")
    p.add_argument("--layers", type=int, default=layers, help="transformer blocks")
    p.add_argument("--heads", type=int, default=heads, help="attention heads")
    p.add_argument("--lr", type=float, default=lr, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="weights, batches and rounding")


def add_run_options(p: argparse.ArgumentParser, *, text_bytes: int) -> None:
    """--text-bytes (this default), --world-size and --device (auto: see :func:`parse`)."""
    p.add_argument("--text-bytes", type=int, default=text_bytes, help="bytes of training text")
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn without torchrun")
    add_choice(p, "--device", ("auto", "cpu", "cuda"), "auto: cuda if available")


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``p``'s arguments from ``argv``, --device auto made cuda where there is a GPU, else cpu."""
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def sent_said(sent: int, plain: int, digits: int) -> str:
    """The bytes sent against the uncompressed, in MB with ``digits`` decimals ("" if none)."""
    if not sent:
        return ""
    return (
        f", sent {sent / 1e6:.{digits}f} MB vs {plain / 1e6:.{digits}f} MB uncompressed "
        f"({plain / max(sent, 1):.2f}x less)"
    )


def add_recipe_options(p: argparse.ArgumentParser) -> None:
    """The framework recipes' (lightning_*, accelerate_*, torchtitan_fsdp) training options:
    --steps, --batch-size (per rank), --context, --dim, --layers, --heads, --lr and --json."""
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--json", help="write the ranks' bytes and parameter digests here")
