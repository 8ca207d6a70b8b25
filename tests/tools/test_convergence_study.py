"""bench/convergence_study.sh with a stand-in torchrun: unfinished runs dealt round-robin to
the lanes, lane i on GPU i mod the GPUs, a seed a run, no run started that cannot finish."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "bench" / "convergence_study.sh"


def _launches(
    tmp_path: Path, lanes: int, runs: str, done: tuple[str, ...] = (), run_s: int = 1
) -> tuple[list, str]:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    log = tmp_path / "launches"
    (fake / "torchrun").write_text(f'#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES $*" >> {log}\n')
    (fake / "torchrun").chmod(0o755)
    study = tmp_path / "study"
    study.mkdir(exist_ok=True)
    for name in done:
        (study / name).parent.mkdir(parents=True, exist_ok=True)
        (study / name).write_text("{}")
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "NGPU": "2",
        "LANES": str(lanes),
        "DIR": str(study),
        "RUNS": runs,
        "TIMEOUT": "120",
        "RUN_S": str(run_s),
    }
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
