"""End-to-end check of ``python -m cgx2.demo``: two gloo ranks, one small 4-bit case.

Runs the demo as a subprocess and checks its table, its JSON and its exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# 4 bits, bucket 512: a bucket's 2048 fp32 bytes become 8 bytes of (min, step) plus 256 bytes of
# levels. 64K elements over 2 ranks is 64 whole buckets a chunk, so no padding: exactly 2048/264.
RATIO_4BIT_FP32 = 2048 / 264  # 7.7576

# Stochastic rounding to a step s adds error of variance <= s^2/4 (~s^2/6 on average). For
# N(0, 1) inputs a 512-bucket spans ~6.2, so s ~ 6.2/15 at 4 bits; the sum of 2 ranks spans
# ~8.8 when it is quantized a second time. Together that is ~0.04 of the variance of the exact sum
# (2), a relative error of ~0.2 (the demo measures 0.204); 0.3 leaves room, while a broken
# reduction (a rank's contribution lost: ~0.7, or garbage: >> 1) fails.
REL_ERROR_4BIT_BOUND = 0.3


@pytest.mark.slow
def test_demo_runs_and_reports(tmp_path: Path) -> None:
    out_json = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "cgx2.demo", "--sizes", "64K", "--bits", "4", "--iters", "1"]
    proc = subprocess.run(
        [*cmd, "--json", str(out_json)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr

    lines = proc.stdout.splitlines()
    header_at = next(i for i, line in enumerate(lines) if "identical on all ranks" in line)
    assert set(lines[header_at + 1].replace(" ", "")) == {"-"}
    cells = lines[header_at + 2].split()
    assert cells[:2] == ["64K", "4"]
    assert cells[-1] == "yes"
    assert "not bandwidth-bound" in proc.stdout
    assert "size 64K bits 4" in proc.stderr  # progress goes to stderr, not into the table

    report = json.loads(out_json.read_text())
    assert report["world_size"] == 2
    assert "cgx2.demo" in report["command"]
    assert report["torch"] and report["date"]
    (row,) = report["rows"]
    assert row["bits"] == 4 and row["numel"] == 64 * 1024 and row["dtype"] == "fp32"
    assert row["identical"] is True
    assert row["sent_bytes_plain"] == 64 * 1024 * 4  # 2*(W-1)/W * nbytes with W = 2
    assert row["compression_ratio"] == pytest.approx(RATIO_4BIT_FP32, rel=1e-6)
    assert row["compression_ratio"] > 7.7
    assert 0 < row["rel_error"] < REL_ERROR_4BIT_BOUND
    assert row["plain_ms"] > 0 and row["cgx2_ms"] > 0
