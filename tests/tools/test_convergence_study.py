"""bench/convergence_study.sh with a stand-in torchrun: unfinished runs dealt round-robin to
the lanes, lane i on GPU i mod the GPUs, a seed a run, no run started that cannot finish."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "bench" / "convergence_study.sh"


def _launches(
    tmp_path: Path, lanes: int, runs: str | None, done: tuple[str, ...] = (), run_s: int = 1
) -> tuple[list, str]:
    fake = tmp_path / "bin"
    fake.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "launches"
    (fake / "torchrun").write_text(f'#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES $*" >> {log}\n')
    (fake / "torchrun").chmod(0o755)
    study = tmp_path / "study"
    study.mkdir(exist_ok=True)
    for name in done:
        (study / name).parent.mkdir(parents=True, exist_ok=True)
        (study / name).write_text("{}")
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RUNS", "LOW_BITS")},
        "PATH": f"{fake}:{os.environ['PATH']}",
        "NGPU": "2",
        "LANES": str(lanes),
        "DIR": str(study),
        "TIMEOUT": "120",
        "RUN_S": str(run_s),
    }
    if runs is not None:  # else the script's default
        env["RUNS"] = runs
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=SCRIPT.parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    found = []
    for line in log.read_text().splitlines() if log.exists() else []:
        words = line.split()
        found.append(
            (
                words[0],
                words[words.index("--compressors") + 1],
                words[words.index("--only-seed") + 1],
            )
        )
    return sorted(found), proc.stdout


def test_runs_are_dealt_to_lanes_on_the_gpus_a_seed_each(tmp_path):
    got, _ = _launches(tmp_path, 4, "plain cgx4 plain@1 cgx4@1 sd8 thc")
    # lane i: runs i and i + 4; on GPU i mod 2
    assert got == sorted(
        [
            ("0", "plain", "0"),
            ("1", "cgx4", "0"),
            ("0", "plain", "1"),
            ("1", "cgx4", "1"),
            ("0", "sd8", "0"),
            ("1", "thc", "0"),
        ]
    )


def test_finished_runs_start_nothing_and_the_rest_are_dealt_anew(tmp_path):
    got, _ = _launches(
        tmp_path,
        2,
        "plain cgx4 plain@1 sd8 thc",
        done=("run_plain_seed0.json", "run_plain_seed1.json"),
    )
    # cgx4, sd8, thc are unfinished: lane 0 takes cgx4 and thc, lane 1 sd8
    assert got == [("0", "cgx4", "0"), ("0", "thc", "0"), ("1", "sd8", "0")]


def test_a_run_that_cannot_finish_in_the_time_left_is_not_started(tmp_path):
    got, out = _launches(tmp_path, 2, "plain cgx4", run_s=121)
    assert got == []
    assert "plain not started" in out and "cgx4 not started" in out


def test_a_run_left_checkpointed_resumes_even_with_little_time_left(tmp_path):
    got, out = _launches(
        tmp_path, 2, "plain cgx4", done=("checkpoints/cgx4_seed0_rank0.pt",), run_s=121
    )
    assert got == [("1", "cgx4", "0")] and "plain not started" in out


def test_by_default_the_committed_runs_start_nothing_and_the_low_bit_ones_run(tmp_path):
    """With the committed study's runs in DIR (as device_run copies them), the default RUNS
    starts issue 44's compressors only, seed 0 each, every one a compressor of
    examples/convergence.py."""
    low_bits = "cgx2-rot-ef cgx2-rot cgx4-rot cgx3-rot-ef cgx3-rot cgx3 cgx3-ef".split()
    committed = tuple(
        p.name for p in (SCRIPT.parent / "results" / "convergence").glob("run_*.json")
    )
    assert len(committed) >= 18
    got, _ = _launches(tmp_path / "all", 2, None, done=committed)
    assert got == []  # every default run is committed
    before = tuple(n for n in committed if n.split("_")[1] not in low_bits)
    got, _ = _launches(tmp_path / "before", 2, None, done=before)
    names = [name for _, name, _ in got]
    assert sorted(names) == sorted(low_bits)
    assert {seed for _, _, seed in got} == {"0"}
    sys.path.insert(0, str(SCRIPT.parents[1] / "examples"))
    import convergence

    assert set(names) <= set(convergence.COMPRESSORS)


def test_more_seeds_of_any_compressor(tmp_path):
    got, _ = _launches(tmp_path, 1, "cgx2-rot-ef@1 cgx2-rot-ef@2")
    assert got == [("0", "cgx2-rot-ef", "1"), ("0", "cgx2-rot-ef", "2")]
