"""examples/convergence_time.py on the committed study (bench/results/convergence): a row and
a curve for every compressor, time to train = steps x the step's time, the frontier exactly
the undominated ones, the PNG written; step times from another folder where asked."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import convergence_time

STUDY = Path(__file__).parents[2] / "bench" / "results" / "convergence"


def _dominated(r: dict, rows: list[dict]) -> bool:
    return any(
        o["time_s"] <= r["time_s"]
        and o["held_out_loss"] <= r["held_out_loss"]
        and (o["time_s"], o["held_out_loss"]) != (r["time_s"], r["held_out_loss"])
        for o in rows
    )


def test_loss_by_time_of_the_committed_study(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    result = convergence_time.main([str(STUDY), "--out", str(tmp_path)])
    runs = [json.loads(p.read_text()) for p in STUDY.glob("run_*.json")]
    assert {r["compressor"] for r in result["rows"]} == {r["compressor"] for r in runs}
    assert len(result["curves"]) == len(runs) and not result["left_out"]
    for row in result["rows"]:
        own = [r["step_ms"] for r in runs if r["compressor"] == row["compressor"]]
        assert row["step_ms"] == pytest.approx(sum(own) / len(own))
        assert row["time_s"] == pytest.approx(2000 * row["step_ms"] / 1e3)
        assert row["on_frontier"] == (not _dominated(row, result["rows"]))
    assert {"plain", "cgx2"} <= set(result["frontier"])  # the fastest run is on it
    assert (tmp_path / "loss_by_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "loss_by_time.json").read_text())
    assert saved["frontier"] == result["frontier"]
    assert "| CGX 2-bit | 1 | 2.20 |" in capsys.readouterr().out


def test_step_times_from_another_folder(tmp_path, capsys):
    timed = tmp_path / "timed"
    for name, seed, ms in (("plain", 0, 400.0), ("plain", 1, 500.0), ("cgx2", 0, 100.0)):
        run = {"compressor": name, "seed": seed, "step_ms": ms}
        where = timed / f"conv_{name}" if seed == 0 else timed  # nccl_hosts.sh: a folder a run
        where.mkdir(parents=True, exist_ok=True)
        (where / f"run_{name}_seed{seed}.json").write_text(json.dumps(run))
    result = convergence_time.main(
        [str(STUDY), "--step-times", str(timed), "--out", str(tmp_path), "--no-plot"]
    )
    rows = {r["compressor"]: r for r in result["rows"]}
    assert set(rows) == {"plain", "cgx2"} and "cgx4" in result["left_out"]
    assert rows["plain"]["time_s"] == pytest.approx(2000 * 0.45)  # the median of 400 and 500
    assert rows["cgx2"]["time_s"] == pytest.approx(2000 * 0.1)
    assert result["frontier"] == ["cgx2", "plain"]
    assert "no step time for:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        convergence_time.parse_args([str(tmp_path / "none")])
