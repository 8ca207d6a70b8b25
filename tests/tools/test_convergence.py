"""examples/convergence.py, tiny, on 2 CPU processes: the runs' JSON, the table, the summary and
the plots are written, plain and 4-bit losses fall on training and held-out text, a run stopped
for its time limit resumes from its checkpoint as if never stopped, and a rerun skips the
finished runs."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "examples" / "convergence.py"
TINY = (
    "--dim 32 --layers 1 --heads 2 --context 32 --batch-size 8 --steps 40 --warmup 10 --lr 3e-3 "
    "--eval-every 20 --eval-batches 2 --train-bytes 300000 --device cpu"
).split()


def _command(out: Path, *extra: str) -> list[str]:
    compressors = ["--compressors", "plain,cgx4"]
    return [sys.executable, str(SCRIPT), *TINY, *compressors, "--out", str(out), *extra]


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(out, *extra), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_small_study_writes_its_results_and_losses_fall(tmp_path, capsys):
    out = tmp_path / "study"
    # plain uninterrupted, beside (most of a run is starting processes: they overlap)
    whole = subprocess.Popen(
        _command(tmp_path / "whole", "--compressors", "plain"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Out of time at the first evaluation: plain stops there, checkpointed; cgx4 never starts.
    stopped = _run(out, "--time-limit", "0.001")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "plain, seed 0: stopped for --time-limit" in stopped.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "plain_seed0_rank0.pt",
        "plain_seed0_rank1.pt",
    ]
    assert not list(out.glob("run_*.json"))
    done = _run(out)  # plain resumed from step 20, then cgx4
    assert done.returncode == 0, done.stderr[-3000:]
    assert not list((out / "checkpoints").iterdir())
    assert "| CGX 4-bit | 1 |" in done.stdout and "| plain DDP | 1 |" in done.stdout
    for name in (
        "run_plain_seed0.json",
        "run_cgx4_seed0.json",
        "summary.json",
        "loss_by_step.png",
        "loss_by_bytes.png",
    ):
        assert (out / name).stat().st_size > 0, name
    runs = {
        name: json.loads((out / f"run_{name}_seed0.json").read_text()) for name in ("plain", "cgx4")
    }
    for r in runs.values():
        assert "convergence.py" in r["env"]["command"]  # the study's command, not spawn's
        assert len(r["train_losses"]) == 40 and [e["step"] for e in r["evals"]] == [20, 40]
        assert r["train_losses"][-1] < 0.8 * r["train_losses"][0]
        assert r["evals"][-1]["loss"] < r["evals"][0]["loss"]
    # the same initialization and data order: the first step's loss is the same
    assert runs["plain"]["train_losses"][0] == pytest.approx(runs["cgx4"]["train_losses"][0])
    assert runs["cgx4"]["bytes_per_step"] < runs["plain"]["bytes_per_step"] / 5
    summary = json.loads((out / "summary.json").read_text())
    assert {r["compressor"] for r in summary["rows"]} == {"plain", "cgx4"}
    # the resumed run is the uninterrupted one, step for step
    _, whole_err = whole.communicate(timeout=600)
    assert whole.returncode == 0, whole_err[-3000:]
    uninterrupted = json.loads((tmp_path / "whole" / "run_plain_seed0.json").read_text())
    assert runs["plain"]["train_losses"] == uninterrupted["train_losses"]
    assert runs["plain"]["evals"] == uninterrupted["evals"]

    # In this process (no run is pending, so none starts): nothing trains again ...
    convergence, before = _load_script(), (out / "run_cgx4_seed0.json").read_text()
    argv = [*TINY, "--compressors", "plain,cgx4", "--out", str(out)]
    convergence.main(argv)
    assert "| CGX 4-bit | 1 |" in capsys.readouterr().out
    assert (out / "run_cgx4_seed0.json").read_text() == before
    # ... and other settings into the same folder are refused
    with pytest.raises(SystemExit, match="a run of other settings"):
        convergence.main([*argv, "--lr", "1e-3"])


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("convergence_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_summary_compares_with_plains_mean_and_with_plains_run_of_the_same_seed(tmp_path):
    convergence = _load_script()
    finals = {
        ("plain", 0): 1.00,
        ("plain", 1): 1.10,
        ("cgx4", 0): 1.02,
        ("cgx4", 1): 1.10,
        ("cgx2", 0): 1.21,
    }
    for (name, seed), loss in finals.items():
        run = {
            "compressor": name,
            "seed": seed,
            "final_held_out_loss": loss,
            "evals": [],
            "bytes_per_step": 100.0,
            "step_ms": 1.0,
        }
        (tmp_path / f"run_{name}_seed{seed}.json").write_text(json.dumps(run))
    summary = convergence.summarize(tmp_path)
    rows = {r["compressor"]: r for r in summary["rows"]}
    assert summary["plain_spread"] == pytest.approx(0.10)
    assert rows["cgx4"]["vs_plain"] == pytest.approx(1.06 / 1.05 - 1)
    assert rows["cgx4"]["vs_plain_same_seed"] == pytest.approx(0.01)  # (+2% + 0%) / 2
    assert rows["cgx2"]["vs_plain_same_seed"] == pytest.approx(0.21)  # seed 0's plain only
    text = convergence.table(summary)
    assert "| CGX 2-bit | 1 | 1.2100 |" in text and "+21.00% |" in text
    assert "seed spread (max - min held-out loss): 0.1000 (9.52% of its mean)" in text


def test_the_optimizer_marks_a_run_only_when_it_is_not_adamw():
    convergence = _load_script()
    adamw = convergence.parse_args(["--steps", "10"])
    sgd = convergence.parse_args(["--steps", "10", "--optimizer", "sgd"])
    # AdamW's runs keep the fingerprint they had before the option existed
    keys = (
        "dim",
        "layers",
        "heads",
        "context",
        "batch_size",
        "steps",
        "warmup",
        "lr",
        "train_bytes",
        "eval_every",
        "eval_batches",
    )
    legacy = {k: getattr(adamw, k) for k in keys} | {"world": 2}
    want = hashlib.sha1(json.dumps(legacy, sort_keys=True).encode()).hexdigest()[:12]
    assert convergence.fingerprint(adamw, 2) == want
    assert convergence.fingerprint(sgd, 2) != want


@pytest.mark.slow
def test_low_bit_compressors_run_any_seed_and_report_their_bits_a_value(tmp_path):
    """Issue 44's compressors train on CPU: 2 bits rotated with error feedback beside 2 bits
    plain, seed 1 of each (``--only-seed`` runs any compressor's), a few steps: the same bytes
    (rotation and residuals change what is sent, not how much), other steps (the first step
    exact, CGXState's start_iter, so the first two losses agree), and bits a value from the
    bytes the hook counted."""
    out = tmp_path / "low"
    tiny = [a if a != "40" else "4" for a in TINY]  # --steps 4
    tiny[tiny.index("--eval-every") + 1] = "2"
    cmd = [sys.executable, str(SCRIPT), *tiny, "--compressors", "cgx2-rot-ef,cgx2,cgx3a-rot"]
    proc = subprocess.run(
        [*cmd, "--only-seed", "1", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rot, plain2 = (
        json.loads((out / f"run_{name}_seed1.json").read_text()) for name in ("cgx2-rot-ef", "cgx2")
    )
    assert rot["what"] == "CGX 2-bit, rotated, error feedback" and rot["seed"] == 1
    assert rot["train_losses"][:2] == pytest.approx(plain2["train_losses"][:2], rel=1e-6)
    assert rot["train_losses"][2:] != plain2["train_losses"][2:]
    assert rot["bytes_per_step"] == plain2["bytes_per_step"]
    sent = rot["evals"]
    assert rot["bits_per_value"] == pytest.approx(
        32 * sent[-1]["bytes_sent"] / (4 * rot["plain_bytes_per_step"])
    )
    late = 32 * (sent[1]["bytes_sent"] - sent[0]["bytes_sent"]) / (2 * rot["plain_bytes_per_step"])
    # the tiny model's small layers go exact, and the first step too: more than 2 bits
    assert rot["bits_per_value_late"] == pytest.approx(late)
    assert 2 < rot["bits_per_value_late"] < rot["bits_per_value"] < 32
    assert "| CGX 2-bit, rotated, error feedback | 1 |" in proc.stdout
    # Widths by layer error within 3 bits' budget: no layer narrower than 2 bits, so no fewer
    # bytes than 2 bits everywhere, and far fewer than plain's.
    mixed = json.loads((out / "run_cgx3a-rot_seed1.json").read_text())
    assert mixed["what"].startswith("CGX 2/3/4/8-bit by layer error")
    assert plain2["bits_per_value_late"] <= mixed["bits_per_value_late"] < 32


def test_bits_a_value_of_the_committed_study():
    """The committed study's runs (bench/results/convergence): bits a value from the bytes each
    rank counted against plain DDP's ring, metadata included: 2 bits send 2.2, 4 bits 4.2 (a
    bucket of 512 values carries a scale and an offset), plain 32."""
    convergence = _load_script()
    rows = {
        r["compressor"]: r
        for r in convergence.summarize(SCRIPT.parents[1] / "bench/results/convergence")["rows"]
    }
    assert rows["plain"]["bits_per_value"] == rows["plain"]["bits_per_value_late"] == 32
    for name, low, high in (("cgx2", 2.1, 2.3), ("cgx4", 4.1, 4.3), ("cgx8", 8.1, 8.3)):
        assert low < rows[name]["bits_per_value_late"] < rows[name]["bits_per_value"] < high
    text = convergence.table({"rows": list(rows.values()), "plain_spread": None})
    assert "| 7.98 | 2.20 |" in text


def test_the_mixed_width_compressor_stays_within_two_and_a_half_bits_a_value():
    """cgx2.5a-rot (issue 44): 2 bits everywhere plus what its average_bits lets the planner
    spend on top, at most (its payload above 2 bits) on every compressed value, sends at most
    2.5 bits a value over a whole run of the committed study's model: the committed 2-bit
    rotated run's bits a value after the exact first step, plus that room, with the first
    step's 32 bits."""
    convergence = _load_script()
    make_state = convergence.COMPRESSORS["cgx2.5a-rot"][2]
    state = make_state(None)
    assert (state.bits, state.adaptive_bits, state.rotation) == (2, (2, 3, 4, 8), "hadamard")
    narrow = json.loads(
        (SCRIPT.parents[1] / "bench/results/convergence/run_cgx2-rot_seed0.json").read_text()
    )
    steps = len(narrow["train_losses"])
    late = narrow["bits_per_value_late"] + (state.average_bits - state.bits)
    assert (late * (steps - 1) + 32) / steps <= 2.5
