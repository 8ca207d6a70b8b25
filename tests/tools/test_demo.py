"""End-to-end check of ``python -m cgx2.demo``: two gloo ranks, one small 4-bit case.

Runs the demo as a subprocess and checks its table, its legend, what it says of the codec, its
JSON and its exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cgx2.codecs import native

# 4 bits, bucket 512: a bucket's 2048 fp32 bytes become 8 bytes of (min, step) plus 256 bytes of
# levels. 256 KiB (64K elements) over 2 ranks is 64 whole buckets a chunk, so no padding: exactly
# 2048/264.
RATIO_4BIT_FP32 = 2048 / 264  # 7.7576

# Stochastic rounding to a step s adds error of variance <= s^2/4 (~s^2/6 on average). For
# N(0, 1) inputs a 512-bucket spans ~6.2, so s ~ 6.2/15 at 4 bits; the sum of 2 ranks spans
# ~8.8 when it is quantized a second time. Together that is ~0.04 of the variance of the exact sum
# (2), a relative error of ~0.2 (the demo measures 0.204); 0.3 leaves room, while a broken
# reduction (a rank's contribution lost: ~0.7, or garbage: >> 1) fails.
REL_ERROR_4BIT_BOUND = 0.3


@pytest.mark.slow
@pytest.mark.parametrize("native_codec", ["1", "0"])
def test_demo_runs_and_reports(tmp_path: Path, native_codec: str) -> None:
    """--sizes is in bytes; the table has a legend; the note names the codec that ran; the JSON
    goes to ./cgx2-results unless told."""
    cmd = [sys.executable, "-m", "cgx2.demo", "--sizes", "256K", "--bits", "4", "--iters", "2"]
    cmd += ["--seconds", "0"]
    env = {**os.environ, "CGX2_NATIVE": native_codec}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr

    lines = proc.stdout.splitlines()
    header_at = next(i for i, line in enumerate(lines) if "identical on all ranks" in line)
    assert set(lines[header_at + 1].replace(" ", "")) == {"-"}
    cells = lines[header_at + 2].split()
    assert cells[:2] == ["256K", "4"]
    assert cells[-1] == "yes"
    # the speedup is gloo's time over cgx2's (checked against the JSON's exact times below)
    headers = [h.strip() for h in lines[header_at].split("  ") if h.strip()]
    assert headers[2:5] == ["gloo ms", "cgx2 ms", "speedup vs gloo"]
    legend = lines[lines.index("Columns:") + 1 :]
    legend = legend[: legend.index("")]
    assert [line.split(":")[0].strip() for line in legend if not line.startswith("   ")] == headers
    text = " ".join(proc.stdout.split())
    assert "speedup vs gloo: gloo ms / cgx2 ms: above 1, cgx2 is faster" in text
    assert "no network limits either call" in text
    speedup = float(cells[4])
    verdict = "faster than gloo in 1 of the 1 rows" if speedup > 1.1 else "in none of the 1 rows"
    assert verdict in text and f"256K at 4 bits {speedup:.2f}x" in text
    assert "mean of 2 samples" in text  # --seconds 0: exactly --iters
    uses_c = native_codec == "1" and native.library() is not None
    assert ("its CPU codec's C loops" in text) == uses_c
    assert ("its CPU codec's torch code" in text) == (not uses_c)
    assert "reference codec" not in text
    assert "size 256K bits 4" in proc.stderr  # progress goes to stderr, not into the table

    (out_json,) = (tmp_path / "cgx2-results").glob("demo_*.json")
    assert lines[-1] == f"results: {out_json.relative_to(tmp_path)}"
    report = json.loads(out_json.read_text())
    assert report["world_size"] == 2 and report["native_codec"] is uses_c
    assert "cgx2.demo" in report["command"]
    assert report["torch"] and report["date"]
    (row,) = report["rows"]
    assert row["bits"] == 4 and row["dtype"] == "fp32"
    assert cells[4] == f"{row['plain_ms'] / row['cgx2_ms']:.2f}"
    assert row["bytes"] == 256 * 1024 and row["numel"] == 64 * 1024
    assert row["identical"] is True
    assert row["sent_bytes_plain"] == 256 * 1024  # 2*(W-1)/W * nbytes with W = 2
    assert row["compression_ratio"] == pytest.approx(RATIO_4BIT_FP32, rel=1e-6)
    assert row["compression_ratio"] > 7.7
    assert 0 < row["rel_error"] < REL_ERROR_4BIT_BOUND
    assert row["plain_ms"] > 0 and row["cgx2_ms"] > 0
    assert row["iters"] == 2 and row["transport"] in ("shm", "process_group")


def test_demo_sizes_are_bytes(tmp_path: Path) -> None:
    """A size that is not a whole number of values is refused before any process starts."""
    from cgx2.demo import build_parser

    args = build_parser().parse_args(["--sizes", "64K,1M"])
    assert args.sizes == [64 << 10, 1 << 20]
    cmd = [sys.executable, "-m", "cgx2.demo", "--sizes", "1022", "--dtype", "fp32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert "1022 bytes is not a whole number of fp32 values" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_demo_json_path(tmp_path: Path) -> None:
    """--json writes exactly there (and not into ./cgx2-results)."""
    out = tmp_path / "x" / "demo.json"
    cmd = [sys.executable, "-m", "cgx2.demo", "--sizes", "64K", "--bits", "8", "--iters", "1"]
    proc = subprocess.run(
        [*cmd, "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["rows"][0]["bytes"] == 64 << 10
    assert not (tmp_path / "cgx2-results").exists()


@pytest.mark.slow
def test_demo_runs_across_two_hosts_over_a_1gbit_link(netlab, tmp_path: Path) -> None:
    """--hosts 2 --link 1gbit: one rank in each of two hosts, over the shaped link; the table,
    the time saved and the JSON name the hosts and the link (the times themselves are
    BENCHMARKS.md's, not a test's)."""
    out = tmp_path / "hosts.json"
    args = "--hosts 2 --link 1gbit --sizes 4M --bits 4 --iters 3".split()
    cmd = [sys.executable, "-m", "cgx2.demo", *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 hosts joined by 1gbit links" in proc.stdout
    assert "Time saved over the link:" in proc.stdout
    report = json.loads(out.read_text())
    assert report["hosts"] == 2 and report["link"] == "1gbit" and report["world_size"] == 2
    (row,) = report["rows"]
    assert row["identical"] and row["rel_error"] < REL_ERROR_4BIT_BOUND
    # The link is shaped: gloo's 4 MiB cannot cross 1 Gbit/s in under ~34 ms.
    assert row["plain_ms"] > 30
    assert row["compression_ratio"] > 6


def test_demo_across_hosts_says_what_it_needs(monkeypatch, capsys) -> None:
    """Without root or iproute2, --hosts says so and exits 2; it does not fall back silently."""
    from cgx2 import demo
    from cgx2.testing import netlab

    monkeypatch.setattr(netlab, "unavailable", lambda *a: "not root (uid 1000)")
    assert demo.main(["--hosts", "2", "--sizes", "256K", "--bits", "4", "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "needs root and iproute2" in err and "not root (uid 1000)" in err


def test_demo_hosts_must_be_two_or_more() -> None:
    from cgx2 import demo

    with pytest.raises(SystemExit):
        demo.main(["--hosts", "1"])


def _row(size: str, bits: int, plain_ms: float, cgx2_ms: float, rel_error: float = 0.2) -> dict:
    return {
        "size": size,
        "bits": bits,
        "plain_ms": plain_ms,
        "cgx2_ms": cgx2_ms,
        "compression_ratio": 32 / bits,
        "rel_error": rel_error,
        "bucket_range_sd": 6.2,
    }


def test_verdict_reads_the_rows_it_is_given() -> None:
    """The closing lines name the rows cgx2 won, lost and tied, with their speedups: the same
    text for other numbers would be canned."""
    from cgx2.demo import format_verdict

    rows = [_row("1M", 2, 10.0, 5.0), _row("4M", 4, 10.0, 20.0), _row("16M", 8, 10.0, 10.4)]
    text = " ".join(format_verdict(rows, True, "shm").split())
    assert "cgx2 was faster than gloo in 1 of the 3 rows (1M at 2 bits 2.00x)" in text
    assert "slower in 1 (4M at 4 bits 0.50x)" in text
    assert "even, within 10%, in 1 (16M at 8 bits 0.96x)" in text
    assert "through shared memory" in text and "4.0x to 16.0x as many bytes" in text
    assert "Why:" in text and "no network limits either call" in text
    lost = [_row("1M", 2, 5.0, 10.0), _row("4M", 4, 5.0, 10.0)]
    text = " ".join(format_verdict(lost, False, "process_group").split())
    assert "faster than gloo in none of the 2 rows; slower in 2" in text
    assert "its CPU codec's torch code" in text and "through gloo too" in text


def test_error_note_says_an_error_above_one_is_larger_than_the_sum() -> None:
    from cgx2.demo import format_error_note

    rows = [_row("1M", 2, 1, 1, rel_error=1.11), _row("1M", 4, 1, 1, rel_error=0.2)]
    text = " ".join(format_error_note(rows).split())
    assert "At 2 bits the rel. error is 1.11: the error is larger than the exact sum itself" in text
    assert "4 levels per bucket of 512 values" in text
    assert "1/3 of the bucket's range, here 2.1 standard deviations" in text
    text = " ".join(format_error_note(rows[1:]).split())
    assert "At 4 bits the rel. error is 0.20: the error's norm is 20% of the exact sum's" in text
    assert "larger than" not in text


def test_a_timed_sample_is_a_window_of_calls_back_to_back(tmp_path):
    """The demo's timing (demo._timed) makes each sample a window of calls back to back, so that
    a barrier's skew and a wake-up are a small part of it, and reports the time of one call: a
    2 ms call made 5 times a window is timed at about 2 ms, not at the window's length."""
    import time

    import torch.distributed as dist

    from cgx2 import demo

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        made = []

        def call():
            made.append(1)
            time.sleep(0.002)

        (ms,), samples, _ = demo._timed([call], calls=5, iters=3, seconds=0)
    finally:
        dist.destroy_process_group()
    assert samples == 3
    assert len(made) == 1 + samples * 5  # the warm-up call, then the windows
    assert 2.0 <= ms < 4.0


def test_a_window_holds_as_many_calls_in_every_run():
    """A window's calls follow from the tensor's size alone (16M of it, one call at least, 64 at
    most), never from a call timed first: gloo's first calls of a window are its slowest, so a
    count that moved between runs would move gloo's time a call with it."""
    from cgx2.demo import MAX_CALLS, WINDOW_BYTES, calls_a_window

    assert calls_a_window(1 << 20) == WINDOW_BYTES // (1 << 20) == 16
    assert calls_a_window(4 << 20) == 4
    assert calls_a_window(16 << 20) == calls_a_window(1 << 30) == 1
    assert calls_a_window(4 << 10) == MAX_CALLS


def test_the_trimmed_mean_does_not_jump_between_two_modes():
    """Calls of two speeds near even (gloo's, here): one sample more of the slow kind moves a
    median from one speed to the other, the trimmed mean by a share of the gap; and samples
    another process slowed, fewer than TRIM of them, are left out."""
    import statistics

    from cgx2.demo import TRIM, trimmed_mean

    fast_more = [0.3] * 11 + [4.0] * 10
    slow_more = [0.3] * 10 + [4.0] * 11
    assert statistics.median(slow_more) - statistics.median(fast_more) == pytest.approx(3.7)
    assert trimmed_mean(slow_more) - trimmed_mean(fast_more) < 3.7 / 10
    slowed = [1.0] * 18 + [50.0] * int(20 * TRIM)
    assert trimmed_mean(slowed) == 1.0


def test_each_rank_keeps_to_cores_of_its_own():
    """2 ranks on 2 cores: one core each, none shared; more ranks than cores: no rank is
    held to a core (the scheduler spreads them)."""
    from cgx2.demo import rank_cores

    assert [rank_cores(r, 2, [0, 1]) for r in range(2)] == [[0], [1]]
    assert [rank_cores(r, 2, [0, 1, 2, 3, 4]) for r in range(2)] == [[0, 1], [2, 3]]
    assert [rank_cores(r, 4, [0, 1]) for r in range(4)] == [[], [], [], []]


def _time_on_a_rank(rank: int, store: str, clock_rate: float, found) -> None:
    """One rank of test_every_rank_makes_as_many_calls: its clock runs clock_rate times as fast
    as the other's; each call is a collective."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    from cgx2 import demo

    real = time.perf_counter
    demo.time.perf_counter = lambda: real() * clock_rate  # this rank's module alone
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        ones = torch.ones(16)
        made = []

        def call():
            made.append(1)
            dist.all_reduce(ones)
            time.sleep(0.001)

        _, samples, _ = demo._timed([call, call], calls=3, iters=2, seconds=0.2)
        found.put((rank, samples, len(made)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_makes_as_many_calls(tmp_path):
    """The rounds are rank 0's, told to the other: a rank whose clock runs faster makes as many
    calls all the same (were it to stop sooner, its peer's next collective would wait for it
    until the timeout)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    found = ctx.SimpleQueue()
    store = str(tmp_path / "store")
    procs = [
        ctx.Process(target=_time_on_a_rank, args=(rank, store, rate, found))
        for rank, rate in ((0, 1.0), (1, 3.0))
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    (_, samples_0, made_0), (_, samples_1, made_1) = sorted(found.get() for _ in procs)
    assert samples_0 == samples_1 >= 2
    assert made_0 == made_1
