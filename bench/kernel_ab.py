"""Times versions of the max-min Triton kernels against each other in one process, in
interleaved rounds, so that a machine's clocks and its drift weigh on every version alike
(timings of one kernel differ by up to 10% from machine to machine). Each version must write
the current version's bytes; a version that does not is reported, not timed.

Run on a GPU: ``python bench/kernel_ab.py [NAME=PATH ...] [--numel N] [--bits 4,8]``. A
version is a copy of ``cgx2/codecs/maxmin_triton.py``, e.g. from git:
``git show REV:cgx2/codecs/maxmin_triton.py > bench/ab_old.py`` (untracked files travel to
the device machine; its copy of the tree has no git history). "current" is the working tree's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from types import ModuleType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton.testing

import cgx2.codecs
from cgx2.bench.report import environment, format_table, write_json
from cgx2.codecs import maxmin_triton
from cgx2.codecs.layout import ChunkedLayout
from cgx2.codecs.rotation import Rotation

BUCKET = 512


def load_version(name: str, path: str) -> ModuleType:
    """``path`` as a module of the ``cgx2.codecs`` package (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location(f"{cgx2.codecs.__name__}._ab_{name}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path!r} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def workloads(
    codec: ModuleType, x: torch.Tensor, bits: int, rotated: bool = False
) -> dict[str, tuple]:
    """name -> (function, output that must equal the current version's, bytes moved);
    ``rotated``: the calls with a Hadamard rotation (blocks of 128)."""
    rk = {"rotation": Rotation(key=3, block=128)} if rotated else {}
    n = x.numel()
    layout = ChunkedLayout(n, 1, n, bits, BUCKET, False)
    payload = codec.encode(x, bits, BUCKET, key=1, **rk)
    own = x[: n // 4]
    rows = torch.stack([codec.encode(own, bits, BUCKET, key=2, **rk)] * 4)
    out = torch.zeros_like(rows[0])
    dse_args = (rows, own.numel(), own, 1, 0.25, bits, BUCKET, 2)
    size = n * x.element_size()
    return {
        "encode": (
            lambda: codec.encode_chunks(x, layout, 1, out=payload.view(1, -1), **rk),
            payload,
            size + payload.numel(),
        ),
        "decode": (
            lambda: codec.decode(payload, n, bits, BUCKET, x.dtype, **rk),
            codec.decode(payload, n, bits, BUCKET, x.dtype, **rk),
            size + payload.numel(),
        ),
        "dse(K=4)": (
            lambda: codec.decode_sum_encode(*dse_args, out=out, **rk),
            codec.decode_sum_encode(*dse_args, **rk),
            own.numel() * own.element_size() + 4 * rows.shape[1],
        ),
    }


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="*", help="NAME=PATH of a copy of maxmin_triton.py")
    p.add_argument("--numel", type=int, default=64 << 20)
    p.add_argument("--bits", default="4,8")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rep-ms", type=int, default=150)
    p.add_argument("--rotation", action="store_true", help="time the rotated kernels")
    p.add_argument("--out-dir", default="bench/results", help="where the JSON goes ('' for none)")
    args = p.parse_args()
    codecs = {"current": maxmin_triton}
    for spec in args.versions:
        name, sep, path = spec.partition("=")
        if not sep or not name or name in codecs:
            p.error(f"versions are NAME=PATH with distinct names, got {spec!r}")
        codecs[name] = load_version(name, path)
    device = torch.device(args.device)
    base = torch.randn(args.numel, device=device)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    cases = [(d, b) for d in args.dtypes.split(",") for b in map(int, args.bits.split(","))]
    work = {
        (name, d, b): workloads(codec, base.to(dtypes[d]), b, args.rotation)
        for name, codec in codecs.items()
        for d, b in cases
    }
    broken = set()
    for (name, d, b), kernels in work.items():
        for kernel, (_, result, _) in kernels.items():
            expected = work["current", d, b][kernel][1]
            if not torch.equal(_bits_of(result), _bits_of(expected)):
                broken.add((name, d, b, kernel))
                print(f"{name} {d} {b}-bit {kernel}: bytes differ from current's", file=sys.stderr)
    src = torch.empty(args.numel * 4, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times: dict[tuple, list[float]] = {}
    copies: list[float] = []
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", file=sys.stderr)
        copies.append(
            triton.testing.do_bench(lambda: dst.copy_(src), rep=args.rep_ms, return_mode="median")
        )
        for (name, d, b), kernels in work.items():
            for kernel, (fn, _, _) in kernels.items():
                if (name, d, b, kernel) not in broken:
                    ms = triton.testing.do_bench(fn, rep=args.rep_ms, return_mode="median")
                    times.setdefault((name, d, b, kernel), []).append(ms)
    copy_ms = statistics.median(copies)
    copy_gbps = 2 * src.numel() / copy_ms / 1e6
    rows = []
    for (name, d, b, kernel), ms in times.items():
        moved = work[name, d, b][kernel][2]
        current = statistics.median(times["current", d, b, kernel])
        median = statistics.median(ms)
        rows.append(
            {
                "version": name,
                "kernel": kernel,
                "dtype": d,
                "bits": b,
                "ms": median,
                "ms_rounds": ms,
                "vs_current": current / median,
                "gbps": moved / median / 1e6,
                "fraction_of_copy": moved / median / 1e6 / copy_gbps,
            }
        )
    rows.sort(key=lambda row: (row["kernel"], row["dtype"], row["bits"], row["version"]))
    keys = ["kernel", "dtype", "bits", "version"]  # a row's, shown as they are
    columns = [
        *keys,
        ("ms", "ms", ".4f"),
        ("vs_current", "x current", ".3f"),
        ("fraction_of_copy", "of copy", ".0%"),
    ]
    print(format_table(rows, columns))
    same = sorted(broken) or "every version wrote the same bytes"
    print(
        f"copy of {src.numel() >> 20} MiB: {copy_ms:.3f} ms, {copy_gbps:.0f} GB/s (median of "
        f"{args.rounds} rounds); {same}"
    )
    if args.out_dir:
        report = {
            "env": environment(device),
            "numel": args.numel,
            "copy_ms": copy_ms,
            "copy_gbps": copy_gbps,
            "versions": {k: getattr(v, "__file__", "") for k, v in codecs.items()},
            "broken": [list(k) for k in sorted(broken)],
            "rows": rows,
        }
        print(f"raw results: {write_json('kernel_ab', report, args.out_dir)}")


if __name__ == "__main__":
    main()
