"""The CPU allreduce's host buffers kept between calls (cgx2.scratch, by size class) against none
and against keeping them by exact size: one rank's pieces of a two-rank allreduce, its peer
stood in by a copy, in interleaved rounds, calls of one size and of sizes that vary.
``python bench/scratch_ab.py [--rounds 5] [--calls 40] [--out FILE]``; table on stdout."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from cgx2 import scratch as classes
from cgx2.codecs import maxmin_codec

ar = importlib.import_module("cgx2.collectives.allreduce")
maxmin = importlib.import_module("cgx2.codecs.maxmin")

MiB = 1 << 20
EXACT_COMMIT = "e37c442"  # scratch: buffers kept by exact size (SCRATCH_EXACT: that file elsewhere)


class _Local:
    """Two ranks' exchange where the peer sends what this rank sends."""

    @staticmethod
    def all_gather(out, send, group, async_op=True):
        rows = out.view(2, -1)
        rows[0].copy_(send.reshape(-1))
        rows[1].copy_(send.reshape(-1))

    @staticmethod
    def wait(work):
        pass


class _NoScratch:
    @staticmethod
    def take(numel, dtype, device):
        return torch.empty(numel, dtype=dtype, device=device)

    @staticmethod
    def give(*tensors):
        pass

    @staticmethod
    def cached_bytes():
        return 0

    @staticmethod
    def clear():
        pass


def _exact_module():
    """cgx2.scratch as it was before size classes (buffers kept by exact size, up to 1 GiB)."""
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("SCRATCH_EXACT")
    if path is None:
        source = subprocess.run(
            ["git", "-C", root, "show", f"{EXACT_COMMIT}:cgx2/scratch.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        path = os.path.join(tempfile.mkdtemp(), "scratch_exact.py")
        with open(path, "w") as f:
            f.write(source)
    spec = importlib.util.spec_from_file_location("scratch_exact", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUN = {
    "group": None,
    "world": 2,
    "rank": 0,
    "bucket_size": 512,
    "skip_incomplete": False,
    "scale": None,
    "scatter_key": 11,
    "gather_key": 12,
    "gather_in_place": False,
    "pair_gather": True,
    "transport": _Local,
    "rotation": None,
    "rotation_key": 13,
}
"""The allreduce's run (``_Run``'s fields by name) but for what a call sets: rank 0 of two,
no group, the local transport, no rotation."""


def one_call(x: torch.Tensor, out: torch.Tensor, bits: int) -> None:
    run = ar._Run(**RUN, bits=bits, codec=maxmin_codec(x.device), step=x.numel())
    ar._pipeline(run, x, out, None)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    modes = {"none": _NoScratch, "exact": _exact_module(), "classes": classes}
    rng = random.Random(0)
    fixed = [4 * MiB // 4] * args.calls
    varying = [rng.randrange(MiB // 4, 16 * MiB // 4) for _ in range(args.calls)]
    inputs = {n: torch.randn(n) for n in set(fixed + varying)}
    outs = {n: torch.empty(n) for n in inputs}
    times: dict[tuple[str, str], list[float]] = {}
    kept: dict[tuple[str, str], int] = {}
    for _ in range(args.rounds):
        for workload, sizes in (("4 MiB each call", fixed), ("1-16 MiB varying", varying)):
            for name, module in modes.items():
                ar.scratch = maxmin.scratch = module
                module.clear()
                one_call(inputs[sizes[0]], outs[sizes[0]], args.bits)  # warm
                start = time.perf_counter()
                for n in sizes:
                    one_call(inputs[n], outs[n], args.bits)
                seconds = (time.perf_counter() - start) / len(sizes)
                times.setdefault((workload, name), []).append(seconds)
                kept[workload, name] = module.cached_bytes()
                module.clear()
    ar.scratch = maxmin.scratch = classes
    rows = []
    for (workload, name), ts in times.items():
        rows.append(
            {
                "workload": workload,
                "scratch": name,
                "ms": 1e3 * statistics.median(ts),
                "kept_mib": kept[workload, name] / MiB,
            }
        )
    for r in rows:
        print(
            f"{r['workload']:18} {r['scratch']:8} {r['ms']:8.2f} ms  kept {r['kept_mib']:7.1f} MiB"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"torch": torch.__version__, "cpu": os.cpu_count(), "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
