"""examples/convergence.py, tiny, on 2 CPU processes: the runs' JSON, the table, the summary and
the plots are written, plain and 4-bit losses fall on training and held-out text, and a rerun
skips the finished runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "examples" / "convergence.py"
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--context", "32", "--batch-size", "8",
        "--steps", "60", "--warmup", "10", "--lr", "3e-3", "--eval-every", "30",
        "--eval-batches", "2", "--train-bytes", "300000", "--device", "cpu"]  # fmt: skip


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), *TINY, "--compressors", "plain,cgx4", "--out", str(out),
           *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_small_study_writes_its_results_and_losses_fall(tmp_path):
    out = tmp_path / "study"
    done = _run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| CGX 4-bit | 1 |" in done.stdout and "| plain DDP | 1 |" in done.stdout
    for name in ("run_plain_seed0.json", "run_cgx4_seed0.json", "summary.json",
                 "loss_by_step.png", "loss_by_bytes.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    runs = {name: json.loads((out / f"run_{name}_seed0.json").read_text())
            for name in ("plain", "cgx4")}  # fmt: skip
    for r in runs.values():
        assert len(r["train_losses"]) == 60 and [e["step"] for e in r["evals"]] == [30, 60]
        assert r["train_losses"][-1] < 0.8 * r["train_losses"][0]
        assert r["evals"][-1]["loss"] < r["evals"][0]["loss"]
    # the same initialization and data order: the first step's loss is the same
    assert runs["plain"]["train_losses"][0] == pytest.approx(runs["cgx4"]["train_losses"][0])
    assert runs["cgx4"]["bytes_per_step"] < runs["plain"]["bytes_per_step"] / 5
    summary = json.loads((out / "summary.json").read_text())
    assert {r["compressor"] for r in summary["rows"]} == {"plain", "cgx4"}

    before = (out / "run_cgx4_seed0.json").read_text()
    again = _run(out)  # every run is done: nothing trains again
    assert again.returncode == 0, again.stderr[-3000:]
    assert "seed 0" not in again.stderr and (out / "run_cgx4_seed0.json").read_text() == before

    other = _run(out, "--lr", "1e-3")  # other settings into the same folder: refused
    assert other.returncode != 0 and "a run of other settings" in other.stderr
