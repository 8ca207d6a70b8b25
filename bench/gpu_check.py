"""GPU check of the max-min codec: Triton kernels against the torch reference, bit for bit, on CUDA,
then the kernels' throughput (encode, decode, decode-sum-encode) against a device-to-device copy.
"""

from __future__ import annotations

import os
import sys

# Before torch/triton are imported: the repo root goes on sys.path (so `import cgx2` works without
# installing) and the hidden CPU smoke mode (`--device cpu`) needs Triton's interpreter.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.update(
    {"TRITON_INTERPRET": "1"}
    if any(
        a == "--device=cpu" or (p == "--device" and a == "cpu")
        for p, a in zip(sys.argv, sys.argv[1:], strict=False)
    )
    else {}
)

import argparse
import datetime
import hashlib
import json
import platform
import re
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

from cgx2.bench.kernels import (
    CONVENTIONS,
    DTYPE_NAME,
    KEY,
    K,
    format_timing,
    log,
    run_timing,
)
from cgx2.bench.kernels import make_input as scaled_randn
from cgx2.codecs import maxmin as ref
from cgx2.codecs import maxmin_triton as tri
from cgx2.codecs.layout import ChunkedLayout, MaxMinLayout
from cgx2.codecs.rotation import Rotation

SMALL_KEY = 0x12345678_00000042  # both halves < 2**31 (passed as int32: another specialization)
ROTATION_KEY = 0x9E3779B9_7F4A7C15  # the signs' key of the rotated cases
STREAM = 3
DSE_STREAM = 7
OWN_INDEX = 1
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
INT_VIEW = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}
FULL_OPS = ("encode", "decode", "dse", "dse_noscale", "chunks")
BIG_OPS = ("encode", "decode", "dse", "chunks")
M16 = 16 * 1024 * 1024
M64 = 64 * 1024 * 1024


# --------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Profile:
    """Sizes for one run: ``full`` (default), ``quick`` or ``tiny`` (CPU smoke test)."""

    name: str
    small: tuple[int, ...]  # every width 1..8, bucket 512
    big: tuple[int, ...]  # widths ``big_bits``, bucket 512
    big_bits: tuple[int, ...]
    huge: int  # encode (+ decode) bytes at 4 bits; 0 = none
    odd: tuple[int, ...]  # buckets 128 and 2048
    skip: tuple[int, ...]  # skip_incomplete=True
    edge_buckets: int
    timing_numel: int


PROFILES = {
    "full": Profile(
        "full",
        (1, 1000, 4099),
        (1_000_003, M16),
        (1, 2, 3, 4, 5, 8),
        M64,
        (1000, 70_001),
        (1, 1000, 1_000_003),
        9,
        M64,
    ),
    "quick": Profile(
        "quick",
        (1, 1000, 4099),
        (1_000_003,),
        (2, 4, 8),
        0,
        (1000, 70_001),
        (1, 1000, 70_001),
        9,
        M16,
    ),
    "tiny": Profile("tiny", (1, 1000), (5003,), (2, 4), 20_000, (700, 2500), (1, 1000), 9, 16_384),
}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    numel: int
    bits: int
    bucket: int
    skip: bool = False
    ops: tuple[str, ...] = FULL_OPS
    data: str = "randn"  # or "edge": constant, +-inf, NaN, +-3e38, subnormal, 1e-38, zero, 1e34
    key: int = KEY
    rotation: int = 0  # the Hadamard rotation's block (0: none)

    @property
    def label(self) -> str:
        extra = (" skip" if self.skip else "") + (f" {self.data}" if self.data != "randn" else "")
        extra += " key<2^31" if self.key != KEY else ""
        extra += f" rot{self.rotation}" if self.rotation else ""
        return f"{DTYPE_NAME[self.dtype]} n={self.numel} b={self.bits} B={self.bucket}{extra}"

    def rotation_kw(self) -> dict[str, Rotation]:
        """The codec functions' keyword for this case's rotation (none: empty)."""
        return {"rotation": Rotation(ROTATION_KEY, self.rotation)} if self.rotation else {}


def build_cases(p: Profile) -> list[Case]:
    """Checks in priority order (the budget cuts from the end): the small and the edge-value
    cases first, the big lengths last; kernels compile once per (dtype, bits, bucket, skip,
    ...) so each new combination is followed by its reuses."""
    cases: list[Case] = []
    # 1. Main bucket, every width, small lengths (1000 and 4099 leave an incomplete bucket).
    for dtype in (F32, BF16):
        for bits in range(1, 9):
            ops = FULL_OPS if dtype is F32 or bits == 4 else BIG_OPS
            cases += [Case(dtype, n, bits, 512, ops=ops) for n in p.small]
    # 2. Non-finite, overflowing-span, subnormal and constant buckets.
    for dtype, bits, bucket in (
        (F32, 1, 512),
        (F32, 4, 512),
        (F32, 8, 512),
        (BF16, 4, 512),
        (F32, 4, 2048),
        (F32, 3, 128),
    ):
        n = p.edge_buckets * bucket + bucket // 2 + 3
        for skip in (False, True):
            ops = FULL_OPS if bucket == 512 else BIG_OPS
            cases.append(Case(dtype, n, bits, bucket, skip=skip, ops=ops, data="edge"))
    # 3. Multi-tile path (bucket 2048 > BLOCK 1024) and a small bucket.
    for bucket, widths in (
        (2048, {F32: (1, 3, 4, 8), BF16: (2, 4)}),
        (128, {F32: (3, 4), BF16: (4,)}),
    ):
        for dtype, bits_list in widths.items():
            for bits in bits_list:
                cases += [Case(dtype, n, bits, bucket, ops=BIG_OPS) for n in p.odd]
    # 4. skip_incomplete=True (the False side of the same lengths is covered above).
    for bucket, dtype, bits in ((512, F32, 4), (512, F32, 2), (512, F32, 8), (512, BF16, 4)):
        cases += [Case(dtype, n, bits, bucket, skip=True) for n in p.skip]
    for bucket, dtype, bits in ((2048, F32, 4), (128, F32, 3)):
        cases += [Case(dtype, n, bits, bucket, skip=True, ops=BIG_OPS) for n in p.odd]
    # 5. fp16 once; own=None; a key whose halves pass as int32.
    cases += [Case(F16, n, 4, 512) for n in (4099, p.big[0])]
    cases.append(Case(F32, 4099, 4, 512, ops=("dse_noown",)))
    cases.append(Case(BF16, 4099, 4, 512, ops=("dse_noown",)))
    cases.append(Case(F32, 4099, 4, 512, ops=("encode", "dse", "chunks"), key=SMALL_KEY))
    # 5b. The Hadamard rotation fused into the kernels: 2, 3, 4 and 8 bits, every dtype, part
    # blocks (1000, 4099: n % 128 != 0), raw tails, edge values, wide and small buckets,
    # blocks of 128 and others.
    for dtype in (F32, BF16, F16):
        for bits in (2, 3, 4, 8):
            cases += [Case(dtype, n, bits, 512, rotation=128) for n in p.small]
    cases += [Case(F32, n, 4, 512, skip=True, rotation=128) for n in p.skip]
    for bits in (1, 4, 8):
        n = p.edge_buckets * 512 + 512 // 2 + 3
        cases.append(Case(F32, n, bits, 512, data="edge", rotation=128))
    for bucket, block, dtype in (
        (2048, 128, F32),
        (2048, 2048, F32),
        (128, 64, BF16),
        (100, 4, F32),
    ):
        cases += [Case(dtype, n, 3, bucket, ops=BIG_OPS, rotation=block) for n in p.odd]
    # 6. Big lengths, main bucket (the slowest: last).
    for n in p.big:
        for dtype in (F32, BF16):
            cases += [Case(dtype, n, bits, 512, ops=BIG_OPS) for bits in p.big_bits]
        cases += [Case(BF16, n, bits, 512, ops=BIG_OPS, rotation=128) for bits in (2, 4)]
    # 7. Huge: encode bytes (and decode) at 4 bits.
    if p.huge:
        cases.append(Case(F32, p.huge, 4, 512, ops=("encode", "decode")))
        cases.append(Case(BF16, p.huge, 4, 512, ops=("encode",)))
    return cases


# --------------------------------------------------------------------------- data


def make_input(
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    data: str = "randn",
    bucket: int = 512,
) -> torch.Tensor:
    """``cgx2.bench.kernels.make_input``'s Gaussian values whose scale changes every 256
    elements; ``edge`` puts special buckets first."""
    if data != "edge":
        return scaled_randn(n, dtype, device, seed)
    x = scaled_randn(n, F32, device, seed)
    b = bucket
    specials: list[Callable[[torch.Tensor], None]] = [
        lambda s: s.fill_(1.5),
        lambda s: s.__setitem__(len(s) // 3, float("inf")),
        lambda s: s.__setitem__(len(s) // 2, float("nan")),
        lambda s: s.__setitem__(0, float("-inf")),
        lambda s: s.copy_(torch.where(s > 0, 3e38, -3e38)),  # span overflows to inf
        lambda s: s.mul_(1e-40),  # subnormal
        lambda s: s.mul_(1e-38),  # normal, too narrow a span for an fp32 scale at 8 bits
        lambda s: s.copy_(torch.where(s > 0, 0.0, -0.0)),
        lambda s: s.mul_(1e-3).add_(1e4),  # tiny span, large magnitude
        lambda s: s.mul_(1e34),  # finite span near fp32's top (step > 2**104)
    ]
    for i, fill in enumerate(specials):
        if (i + 1) * b <= n:
            fill(x[i * b : (i + 1) * b])
    return x.to(dtype)


# --------------------------------------------------------------------------- comparisons


def _region(layout: MaxMinLayout, off: int) -> str:
    """Where byte ``off`` of a payload lies."""
    if off < layout.raw_offset:
        return f"meta of bucket {off // 8} ({'min' if off % 8 < 4 else 'step'})"
    if off < layout.raw_offset + 4 * layout.raw_numel:
        return f"raw value {(off - layout.raw_offset) // 4}"
    if off < layout.levels_offset:
        return "pad before levels"
    rel = off - layout.levels_offset
    if rel < layout.levels_nbytes:
        return f"levels of bucket {rel // layout.bucket_stride}, byte {rel % layout.bucket_stride}"
    return "trailing pad"


def compare_bytes(
    got: torch.Tensor, want: torch.Tensor, where: Callable[[int], str] | None = None
) -> str | None:
    """None when equal, else a description of the differences."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)}/{got.dtype} != {tuple(want.shape)}/{want.dtype}"
    if torch.equal(got, want):
        return None
    g, w = got.reshape(-1), want.reshape(-1)
    bad = (g != w).nonzero().flatten()
    parts = [f"{bad.numel()} of {g.numel()} bytes differ"]
    for i in bad[:4].tolist():
        region = where(i) if where else ""
        part = f"@{i}" + (f" [{region}]" if region else "") + f": got {int(g[i])} want {int(w[i])}"
        if region.startswith(("meta", "raw")) or ": meta" in region or ": raw" in region:
            a = i // 4 * 4  # meta and raw words are 4-byte aligned (rows are 16-byte multiples)
            gf, wf = g[a : a + 4].view(F32).item(), w[a : a + 4].view(F32).item()
            part += f" (fp32 word: got {gf!r} want {wf!r})"
        parts.append(part)
    return "; ".join(parts)


def compare_values(got: torch.Tensor, want: torch.Tensor, bucket: int) -> str | None:
    """Bitwise comparison of float tensors (signed zeros included). NaN equals NaN whatever
    its bits: GPUs and CPUs produce different NaN payloads from the same arithmetic."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)}/{got.dtype} != {tuple(want.shape)}/{want.dtype}"
    gi, wi = got.view(INT_VIEW[got.dtype]), want.view(INT_VIEW[want.dtype])
    differ = (gi != wi) & ~(got.isnan() & want.isnan())
    if not bool(differ.any()):
        return None
    bad = differ.nonzero().flatten()
    parts = [f"{bad.numel()} of {got.numel()} values differ"]
    g, w = got[bad].float(), want[bad].float()
    if bool((g.isnan() & w.isnan()).all()):
        parts.append("all of them NaN in both: only the NaN bit pattern differs")
    elif bool(((g == 0) & (w == 0)).all()):
        parts.append("all of them zero in both: only the sign of zero differs")
    mask = (1 << (8 * got.element_size())) - 1
    for i in bad[:4].tolist():
        parts.append(
            f"@{i} (bucket {i // bucket}): got {got[i].item()!r} ({int(gi[i]) & mask:#x}) "
            f"want {want[i].item()!r} ({int(wi[i]) & mask:#x})"
        )
    return "; ".join(parts)


# --------------------------------------------------------------------------- checks


@dataclass
class CheckResult:
    name: str
    passed: bool | None  # None: skipped
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Checker:
    """Runs the Triton kernels on ``device`` and the torch reference on ``ref_device``.

    The reference is exact only where torch computes each fp32 operation with IEEE rounding;
    on the CPU it does (see the ``ref_consistency`` section of the report for CUDA)."""

    device: torch.device
    ref_device: torch.device
    results: list[CheckResult] = field(default_factory=list)

    def record(self, name: str, fn: Callable[[], str | None]) -> None:
        t = time.monotonic()
        try:
            detail = fn()
        except Exception as e:  # a crash is a failure, with where it happened
            tb = traceback.format_exc().strip().splitlines()
            detail = f"raised {type(e).__name__}: {e} | " + " | ".join(tb[-4:])
        res = CheckResult(name, detail is None, detail or "", time.monotonic() - t)
        self.results.append(res)
        if not res.passed:
            print(f"FAIL {name}: {res.detail}", flush=True)

    def run_case(self, c: Case) -> None:
        dev, rdev = self.device, self.ref_device
        seed = (c.numel * 131 + c.bits * 17 + c.bucket + int(c.skip)) % (2**31)
        x = make_input(c.numel, c.dtype, dev, seed, c.data, c.bucket)
        xr = x.to(rdev)
        lay = MaxMinLayout(c.numel, c.bits, c.bucket, c.skip)
        args = (c.bits, c.bucket)
        rk = c.rotation_kw()

        def where(i: int) -> str:
            return _region(lay, i)

        want_payload = ref.encode(xr, *args, c.key, STREAM, c.skip, **rk)
        payload = want_payload.to(dev)
        # Twice each up to 1M values: a shape's second call launches its bound variant (no
        # dispatch); the kernel is the same, so larger inputs add time, not coverage.
        for call in ("", " again") if c.numel <= 1 << 20 else ("",):
            if "encode" in c.ops:
                self.record(
                    f"encode{call} {c.label}",
                    lambda: compare_bytes(
                        tri.encode(x, *args, c.key, STREAM, c.skip, **rk).to(rdev),
                        want_payload,
                        where,
                    ),
                )
            if "decode" in c.ops:
                self.record(
                    f"decode{call} {c.label}",
                    lambda: compare_values(
                        tri.decode(payload, c.numel, *args, c.dtype, c.skip, **rk).to(rdev),
                        ref.decode(want_payload, c.numel, *args, c.dtype, c.skip, **rk),
                        c.bucket,
                    ),
                )
        dse_ops = [op for op in c.ops if op.startswith("dse")]
        if dse_ops:
            # Input rows: any valid payloads will do; the (fast) kernels write them.
            rows = torch.zeros(K, lay.nbytes, dtype=torch.uint8, device=dev)
            for w in range(K):
                xw = make_input(c.numel, c.dtype, dev, seed + 1000 + w, c.data, c.bucket)
                tri.encode(xw, *args, c.key, w, c.skip, out=rows[w], **rk)
            rows_r = rows.to(rdev)
            own = make_input(c.numel, c.dtype, dev, seed + 2000, c.data, c.bucket)
            own_r = own.to(rdev)
            variants = {
                "dse": (OWN_INDEX, 0.25, True),
                "dse_noscale": (OWN_INDEX, None, True),
                "dse_noown": (-1, 0.25, False),
            }
            for op in dse_ops:
                idx, scale, has_own = variants[op]
                name = f"{op}(K={K},own_index={idx},scale={scale}) {c.label}"
                self.record(
                    name,
                    lambda idx=idx, scale=scale, h=has_own: compare_bytes(
                        tri.decode_sum_encode(
                            rows,
                            c.numel,
                            own if h else None,
                            idx,
                            scale,
                            *args,
                            c.key,
                            DSE_STREAM,
                            c.skip,
                            **rk,
                        ).to(rdev),
                        ref.decode_sum_encode(
                            rows_r,
                            c.numel,
                            own_r if h else None,
                            idx,
                            scale,
                            *args,
                            c.key,
                            DSE_STREAM,
                            c.skip,
                            **rk,
                        ),
                        where,
                    ),
                )
        if "chunks" in c.ops:
            cl = ChunkedLayout.split(c.numel, K, c.bits, c.bucket, c.skip)

            def where_row(i: int) -> str:
                row, off = divmod(i, max(cl.payload_nbytes, 1))
                return f"row {row}: " + _region(cl.chunk(row), off)

            want_rows = ref.encode_chunks(xr, cl, c.key, **rk)
            for skip_chunk in (-1, 1):
                self.record(
                    f"encode_chunks(K={K},skip_chunk={skip_chunk}) {c.label}",
                    lambda s=skip_chunk: compare_bytes(
                        tri.encode_chunks(x, cl, c.key, s, **rk).to(rdev),
                        want_rows if s == -1 else ref.encode_chunks(xr, cl, c.key, s, **rk),
                        where_row,
                    ),
                )
            rows_dev = want_rows.to(dev)
            self.record(
                f"decode_chunks(K={K}) {c.label}",
                lambda: compare_values(
                    tri.decode_chunks(rows_dev, cl, c.dtype, **rk).to(rdev),
                    ref.decode_chunks(want_rows, cl, c.dtype, **rk),
                    c.bucket,
                ),
            )


def run_checks(
    prof: Profile,
    device: torch.device,
    ref_device: torch.device,
    budget_s: float,
    match: str = "",
    shard: tuple[int, int] = (0, 1),
) -> list[CheckResult]:
    checker = Checker(device, ref_device)
    index, shards = shard
    cases = [c for c in build_cases(prof) if match in c.label][index::shards]
    deadline = time.monotonic() + budget_s
    log(f"checks: {len(cases)} cases ({prof.name} sizes), budget {budget_s:.0f} s")
    for i, c in enumerate(cases):
        if time.monotonic() > deadline:
            for rest in cases[i:]:
                checker.results.append(
                    CheckResult(
                        f"{','.join(rest.ops)} {rest.label}", None, "skipped: check budget spent"
                    )
                )
            log(f"check budget spent: {len(cases) - i} cases skipped")
            break
        before = len(checker.results)
        t = time.monotonic()
        try:
            checker.run_case(c)
        except Exception as e:  # setup (reference, inputs) crashed: one failure for the case
            msg = f"raised {type(e).__name__}: {e} | {traceback.format_exc()[-600:]}"
            checker.record(f"setup {c.label}", lambda msg=msg: msg)
        new = checker.results[before:]
        bad = sum(not r.passed for r in new)
        log(
            f"case {i + 1}/{len(cases)} {c.label} [{','.join(c.ops)}]: "
            f"{len(new) - bad}/{len(new)} ok ({time.monotonic() - t:.2f}s)"
        )
        if c.numel >= M16 and device.type == "cuda":
            torch.cuda.empty_cache()
    return checker.results


def run_workers(args: argparse.Namespace, workers: int) -> list[CheckResult]:
    """The checks split over ``workers`` processes, case ``i`` to worker ``i % workers``, each
    on a GPU of its own where there are enough (round robin otherwise): each case compiles its
    kernels cold, on one CPU core, so a full check is bound by the compiles, not by the GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    common = ["--skip-timing", "--check-budget", str(args.check_budget)]
    common += ["--match", args.match, "--ref-device", args.ref_device, "--device", args.device]
    common += ["--quick"] * args.quick + ["--tiny"] * args.tiny
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for k in range(workers):
            out = os.path.join(tmp, f"{k}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *common]
            cmd += ["--shard", f"{k}/{workers}", "--checks-json", out]
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[k % len(gpus)]} if gpus else None
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL), out))
        shards = []
        for k, (proc, out) in enumerate(procs):
            code = proc.wait()
            if os.path.exists(out):
                with open(out) as f:
                    shards.append([CheckResult(**r) for r in json.load(f)])
            else:
                shards.append([CheckResult(f"worker {k}", False, f"exited {code}, no results")])
    return [row for rows in shards for row in rows]  # worker by worker, not the cases' order


def ref_consistency(device: torch.device) -> list[dict[str, Any]]:
    """Info, not counted: the torch reference run on ``device`` against the same reference on
    the CPU (where it defines the bytes), and torch's own division by a Python scalar."""
    rows: list[dict[str, Any]] = []
    cpu = torch.device("cpu")

    def add(name: str, detail: str | None) -> None:
        rows.append({"name": name, "equal": detail is None, "detail": detail or ""})

    for dtype, bits in ((F32, 2), (F32, 4), (F32, 8), (BF16, 4)):
        n = 1_000_003
        x = make_input(n, dtype, device, 777)
        lay = MaxMinLayout(n, bits, 512)
        add(
            f"ref.encode {DTYPE_NAME[dtype]} n={n} b={bits}: {device.type} vs cpu",
            compare_bytes(
                ref.encode(x, bits, 512, KEY, STREAM).to(cpu),
                ref.encode(x.to(cpu), bits, 512, KEY, STREAM),
                lambda i, lay=lay: _region(lay, i),
            ),
        )
    x = make_input(4867, F32, cpu, 778, "edge", 512)
    payload = ref.encode(x, 4, 512, KEY, STREAM)
    add(
        f"ref.decode to bf16 with NaN buckets: {device.type} vs cpu",
        compare_values(
            ref.decode(payload.to(device), 4867, 4, 512, BF16).to(cpu),
            ref.decode(payload, 4867, 4, 512, BF16),
            512,
        ),
    )
    t = torch.rand(1_000_000, generator=torch.Generator().manual_seed(1)) * 1000
    for lmax in (3.0, 15.0, 255.0):
        got = (t.to(device) / lmax).to(cpu)
        want_div = t / lmax
        want_mul = t * torch.tensor(1.0 / lmax)
        diff = int((got != want_div).sum())
        detail = None
        if diff:
            detail = (
                f"{diff} of {t.numel()} quotients differ from the CPU's; "
                f"{int((got != want_mul).sum())} differ from x * fp32(1/{lmax:g})"
            )
        add(f"torch fp32 tensor / {lmax:g} (Python scalar): {device.type} vs cpu", detail)
    return rows


# --------------------------------------------------------------------------- report


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "device": "cpu",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device=torch.cuda.get_device_name(device),
            capability=list(torch.cuda.get_device_capability(device)),
            sm_count=props.multi_processor_count,
            total_memory=props.total_memory,
        )
        try:
            nccl = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as e:
            env["nccl"] = f"unavailable ({e})"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["source_sha256"] = {}
    for rel in (
        "cgx2/codecs/maxmin.py",
        "cgx2/codecs/maxmin_triton.py",
        "cgx2/codecs/layout.py",
        "cgx2/codecs/philox.py",
        "cgx2/codecs/packing.py",
        "bench/gpu_check.py",
        "cgx2/bench/kernels.py",
    ):
        with open(os.path.join(root, rel), "rb") as f:
            env["source_sha256"][rel] = hashlib.sha256(f.read()).hexdigest()[:16]
    return env


def write_json(report: dict[str, Any], device_name: str) -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    slug = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") or "unknown"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    paths = [os.path.join(root, "bench", "results", f"gpu_check_{slug}_{stamp}.json")]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], "gpu_check.json"))
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return paths


def print_summary(report: dict[str, Any], paths: list[str]) -> None:
    env = report["environment"]
    print(
        f"\n===== gpu_check: {env['device']} | torch {env['torch']} | triton {env['triton']} | "
        f"CUDA {env['cuda']} | NCCL {env.get('nccl')} | {env['date_utc']}"
    )
    checks = report["checks"]
    if checks is not None:
        failed = [r for r in checks if r["passed"] is False]
        skipped = [r for r in checks if r["passed"] is None]
        passed = sum(r["passed"] is True for r in checks)
        edge = sum(" edge" in r["name"] for r in failed)
        print(
            f"checks: {passed} passed, {len(failed)} failed ({edge} on edge-value data), "
            f"{len(skipped)} skipped (budget) in {report['check_seconds']:.1f} s; "
            f"reference on {report['ref_device']}"
        )
        if failed:
            by_op: dict[str, int] = {}
            for r in failed:
                op = r["name"].split(" ")[0].split("(")[0]
                by_op[op] = by_op.get(op, 0) + 1
            print("  failures by op: " + ", ".join(f"{k} {v}" for k, v in sorted(by_op.items())))
        for r in failed[:12]:
            print(f"  FAIL {r['name']}: {r['detail'][:200]}")
        if len(failed) > 12:
            print(f"  ... {len(failed) - 12} more failures (see the JSON / FAIL lines above)")
    else:
        print("checks: skipped (--skip-checks)")
    info = report["ref_consistency"]
    if info:
        same = sum(r["equal"] for r in info)
        print(f"reference on the GPU vs on the CPU (info, not counted): {same} of {len(info)} same")
        for r in info:
            if not r["equal"]:
                print(f"  differ: {r['name']}: {r['detail'][:160]}")
    rows = report["timing"]
    if rows:
        print(format_timing(rows))
    elif report.get("timing_error"):
        print(f"timing: FAILED: {report['timing_error'][:300]}")
    else:
        print("timing: skipped (--skip-timing)")
    print("json: " + ", ".join(paths))
    status = "FAILED" if report["failed"] else "OK"
    print(f"===== {status}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes: checks up to ~1M elements, timing on 16M elements",
    )
    ap.add_argument("--skip-checks", action="store_true", help="only time the kernels")
    ap.add_argument("--skip-timing", action="store_true", help="only check the bytes")
    ap.add_argument(
        "--match", default="", help="only the cases whose label contains this (e.g. 'edge')"
    )
    ap.add_argument(
        "--check-budget",
        type=float,
        default=200.0,
        help="seconds for the checks; cases left when it runs out are reported as "
        "skipped (default 200)",
    )
    ap.add_argument(
        "--timing-numel",
        type=int,
        default=0,
        help="elements of the timed tensor (default 64M, 16M with --quick)",
    )
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench rep time per measurement")
    ap.add_argument(
        "--rotation",
        choices=("hadamard",),
        default=None,
        help="time the rotated kernels too, beside the unrotated ones (the checks always "
        "include rotated cases; --match rot selects them)",
    )
    ap.add_argument(
        "--ref-device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the torch reference runs (default cpu: on CUDA torch divides by a Python "
        "scalar through its reciprocal, so the reference itself is off by an ulp there)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes the checks are split over, each on its own GPU where there are "
        "enough (default 1; the budget applies to each)",
    )
    ap.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    ap.add_argument("--checks-json", default="", help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available (use the GPU machine)", file=sys.stderr)
        return 2
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu needs TRITON_INTERPRET=1 before triton is imported", file=sys.stderr)
        return 2
    prof = PROFILES["tiny" if args.tiny else "quick" if args.quick else "full"]
    env = environment(device)
    log(
        f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, profile {prof.name}"
    )
    report: dict[str, Any] = {
        "environment": env,
        "ref_device": None,
        "ref_consistency": [],
        "profile": prof.name,
        "checks": None,
        "check_seconds": 0.0,
        "timing": [],
        "timing_error": None,
        "conventions": CONVENTIONS,
    }
    if not args.skip_checks:
        t = time.monotonic()
        ref_device = torch.device(args.ref_device if device.type == "cuda" else "cpu")
        report["ref_device"] = str(ref_device)
        index, shards = (int(v) for v in args.shard.split("/"))
        if args.workers > 1:
            results = run_workers(args, args.workers)
        else:
            results = run_checks(
                prof, device, ref_device, args.check_budget, args.match, (index, shards)
            )
        if args.checks_json:  # a worker of run_workers: its results are all it gives back
            with open(args.checks_json, "w") as f:
                json.dump([vars(r) for r in results], f)
            return 0
        report["check_seconds"] = time.monotonic() - t
        report["checks"] = [vars(r) for r in results]
        if device.type != "cpu":
            log("reference consistency (info)")
            try:
                report["ref_consistency"] = ref_consistency(device)
            except Exception as e:
                report["ref_consistency"] = [{"name": "error", "equal": False, "detail": str(e)}]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_timing:
        n = args.timing_numel or prof.timing_numel
        log(f"timing on {n:,} elements")
        try:
            report["timing"] = run_timing(n, device, args.rep_ms, rotation=args.rotation)
        except Exception as e:
            report["timing_error"] = f"{type(e).__name__}: {e} | {traceback.format_exc()[-800:]}"
            log(f"timing failed: {report['timing_error']}")
    checks = report["checks"] or []
    report["failed"] = any(r["passed"] is False for r in checks) or bool(report["timing_error"])
    paths = write_json(report, env["device"])
    print_summary(report, paths)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
