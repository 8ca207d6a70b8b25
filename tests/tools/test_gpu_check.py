"""bench/gpu_check.py on the CPU under Triton's interpreter (its hidden smoke mode): the checks
split over worker processes are the same checks, with the same results, as one process's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

pytest.importorskip("triton")


def _checks(tmp_path: Path, workers: int) -> list[dict]:
    """The checks' records of one run of a copy of gpu_check.py beside a link to the package
    (its JSON lands in the copy's tree, not the repo's)."""
    bench = tmp_path / f"w{workers}" / "bench"
    bench.mkdir(parents=True)
    (bench.parent / "cgx2").symlink_to(ROOT / "cgx2")
    shutil.copy(ROOT / "bench" / "gpu_check.py", bench)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": ""}
    args = ["--device", "cpu", "--tiny", "--skip-timing", "--match", "fp32 n=1000 b=2 B=512"]
    done = subprocess.run(
        [sys.executable, str(bench / "gpu_check.py"), *args, "--workers", str(workers)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (path,) = (bench / "results").glob("gpu_check_*.json")
    return json.loads(path.read_text())["checks"]


def test_workers_run_every_check_once(tmp_path: Path) -> None:
    one, two = _checks(tmp_path, 1), _checks(tmp_path, 2)
    assert len(one) > 3 and all(r["passed"] for r in one)
    assert sorted((r["name"], r["passed"]) for r in two) == sorted(
        (r["name"], r["passed"]) for r in one
    )
