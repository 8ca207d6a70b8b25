"""Training with cgx2's hook or backend, then leaving the script without destroying the process
group, exits cleanly every time: no "terminate called" abort at interpreter exit."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
RUNS = 1  # a mode; each run is a fresh torchrun of two processes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hook", "backend"])
def test_training_scripts_exit_cleanly(mode):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    args = f"--steps 3 --text-bytes 100000 --device cpu --mode {mode} --log-every 100".split()
    cmd = [*torchrun, "--master-port", str(port), str(EXAMPLE), *args]
    for run in range(RUNS):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "terminate called" not in done.stderr, (
            f"run {run}: exit {done.returncode}\n{done.stderr[-3000:]}"
        )
