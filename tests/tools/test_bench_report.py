"""What ``python -m cgx2.bench`` prints agrees with itself: the legend says only what applies
to the run (no GPU words on a CPU run), the light goes the way the call went, a % of SoL above
100 and an auto slower than plain are said below the table, and ``--plot`` draws a PNG (or
says how to get matplotlib)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench_cli import _env, _free_port

from cgx2.bench.allreduce import TRANSPORT_WORDS, Run, columns, parse_args, plot, row_notes

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(**changes: object) -> list[dict]:
    row = {
        "dtype": "fp32",
        "size": "1M",
        "bytes": 1 << 20,
        "bits": 4,
        "speedup_vs_plain": 1.0,
        "fraction_of_sol": 0.8,
        "auto_path": "quantized",
        "auto_vs_plain": 1.0,
    }
    return [{**row, **changes}]


def test_legend_says_only_what_applies_to_the_run() -> None:
    """A CPU run's legend names no GPU feature and gives the a2a light only where two ranks
    swap by all_gather; a GPU run on NCCL's names its CUDA graphs."""
    cpu = Run(device_type="cpu", nccl=False, regime="cpu", transport="shm", pair_gather=True)
    meanings = " ".join(m for *_, m in columns("gloo", run=cpu))
    for gpu_words in ("NVLink", "CUDA", "NCCL"):
        assert gpu_words not in meanings
    assert "shared memory" in meanings and "two all_gathers" in meanings
    assert "a2a SoL ms" in [h for _, h, _, _ in columns("gloo", run=cpu)]
    flat = Run(device_type="cpu", nccl=False, regime="cpu", pair_gather=False)
    assert "a2a SoL ms" not in [h for _, h, _, _ in columns("gloo", run=flat)]
    gpu = " ".join(m for *_, m in columns("NCCL", cuda_graphs=True))
    assert "replaying a CUDA graph up to" in gpu and "CGX2_CUDA_GRAPHS=0" in gpu
    # Gathering all (CGX2_ALGORITHM=allgather): its light is one all_gather, no a2a column.
    gathering = Run(device_type="cpu", nccl=False, regime="cpu", gather_all=True)
    said = " ".join(m for *_, m in columns("gloo", run=gathering))
    assert "one all_gather of every rank's whole payload" in said and "all_to_all" not in said
    assert "a2a SoL ms" not in [h for _, h, _, _ in columns("gloo", run=gathering)]


def test_notes_explain_what_the_legend_alone_would_contradict() -> None:
    assert row_notes(_rows(), "gloo") == []
    (note,) = row_notes(_rows(fraction_of_sol=1.3), "gloo")
    assert note.startswith("% of SoL above 100% in 1 rows (fp32 1M 4-bit 130%)")
    (note,) = row_notes(_rows(auto_vs_plain=0.45), "gloo")
    assert "auto quantized and was slower than gloo in 1 rows" in note and "0.45" in note
    (note,) = row_notes(_rows(auto_path="plain", speedup_vs_plain=2.0), "NCCL")
    assert "auto sent plain in 1 rows where cgx2 was faster" in note


def _report(regime: str, sizes: tuple[int, ...]) -> dict:
    rows = [
        {
            "dtype": "fp32",
            "bits": bits,
            "bytes": n,
            "speedup_vs_plain": n / (1 << 20) * bits,
            "auto_vs_plain": 1.0,
        }
        for n in sizes
        for bits in (2, 4)
    ]
    return {"env": {"regime": regime, "device": "cpu", "world_size": 2}, "rows": rows}


def test_plot_writes_a_png_per_regime(tmp_path: Path) -> None:
    """One panel per regime: two regimes draw a PNG twice as wide as one."""
    from matplotlib import image

    one = plot([_report("cpu", (1 << 20, 4 << 20))], tmp_path / "one.png")
    two = plot(
        [_report("cpu", (1 << 20, 4 << 20)), _report("socket", (1 << 20,))],
        tmp_path / "sub" / "two.png",
    )
    for path in (one, two):
        assert path.read_bytes()[:8] == PNG
    height, width = image.imread(one).shape[:2]
    assert image.imread(two).shape[:2] == (height, 2 * width)


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, capsys) -> None:
    """Where matplotlib cannot be imported, --plot is refused before anything runs, saying
    how to get it; without --plot, nothing asks for it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert parse_args(["--sizes", "64K"]).plot is None
    with pytest.raises(SystemExit) as exc:
        parse_args(["--plot", "speedup.png"])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--plot draws with matplotlib, which cannot be imported here" in err
    assert "pip install matplotlib" in err


def test_plot_command_draws_saved_results(tmp_path: Path, capsys) -> None:
    """``python -m cgx2.bench plot RESULT.json... --plot PNG`` draws saved runs, a panel each,
    and refuses a file that is not the allreduce bench's results."""
    from cgx2.bench.__main__ import main

    saved = []
    for regime in ("cpu", "socket"):
        saved.append(tmp_path / f"allreduce_{regime}.json")
        saved[-1].write_text(json.dumps(_report(regime, (1 << 20, 4 << 20))))
    png = tmp_path / "saved.png"
    assert main(["plot", *map(str, saved), "--plot", str(png)]) == 0
    assert capsys.readouterr().out == f"plot: {png}\n"
    assert png.read_bytes()[:8] == PNG
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [{"op": "encode"}]}))
    with pytest.raises(SystemExit) as exc:
        main(["plot", str(other), "--plot", str(tmp_path / "no.png")])
    assert exc.value.code == 2
    assert "not the results of python -m cgx2.bench (allreduce)" in capsys.readouterr().err
    assert not (tmp_path / "no.png").exists()


@pytest.mark.slow
def test_cpu_run_under_torchrun_tells_the_truth(tmp_path: Path) -> None:
    """Two gloo ranks: no GPU words, the light through the call's transport, a % of SoL above
    100 or an auto slower than gloo said below the table, the crossover auto went by in the
    legend, and --plot's PNG written."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launch += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    bench = ["-m", "cgx2.bench", "--sizes", "64K", "--dtypes", "fp32", "--bits", "4"]
    bench += ["--iters", "2", "--warmup", "0", "--plot", "speedup.png", "--out", "out"]
    proc = subprocess.run(
        [*launch, *bench],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_env(CUDA_VISIBLE_DEVICES="", CGX2_CALIBRATION_FILE=str(tmp_path / "none.json")),
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for gpu_words in ("NVLink", "CUDA", "NCCL"):
        assert gpu_words not in text
    assert proc.stdout.splitlines()[-1] == "plot: speedup.png"
    assert (tmp_path / "speedup.png").read_bytes()[:8] == PNG
    (path,) = (tmp_path / "out").glob("allreduce_*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["transport"] in ("shm", "process_group") and row["pair_gather"] is True
    assert f"moved by {TRANSPORT_WORDS[row['transport']]}" in text
    assert (row["fraction_of_sol"] > 1) == ("% of SoL above 100% in 1 rows" in text)
    assert row["auto_crossover_bytes"] == 0 and row["auto_path"] == "quantized"
    assert "The crossover here: fp32 every size (the built-in table's for the cpu regime)" in text
    assert (row["auto_vs_plain"] < 0.9) == ("auto quantized and was slower than gloo" in text)


def test_crossover_words_name_the_settled_crossover_when_rows_differ(monkeypatch) -> None:
    """Across hosts the link is measured at the first call that asks: rows before it went by
    another crossover, and the words name the last one (the run had raised on two values)."""
    import torch

    from cgx2.bench import allreduce as bench_allreduce

    monkeypatch.setattr(bench_allreduce.policy, "calibration", lambda group: {})
    monkeypatch.setattr(bench_allreduce.config, "crossover_override", lambda: None)
    rows = [
        {"dtype": "fp32", "auto_crossover_bytes": 1 << 20},
        {"dtype": "fp32", "auto_crossover_bytes": 64 << 10},
        {"dtype": "fp32", "auto_crossover_bytes": 64 << 10},
    ]
    words = bench_allreduce.crossover_words(rows, torch.device("cpu"), "gloo", "socket")
    assert words.startswith("fp32 from 64 KiB (")
    assert "earlier rows from 1 MiB" in words
