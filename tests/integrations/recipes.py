"""Runs a recipe of examples/ as a user would launch it on 2 processes and returns the JSON its
ranks reported (examples/recipe_report.py): under torchrun, on CPUs (gloo) by default.
A module, not a conftest: tests/conftest.py is the one conftest importable by that name."""

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"


def run_recipe(tmp_path: Path, script: str, *args: str, gpus: bool = False) -> dict:
    """``run_recipe(tmp_path, "lightning_ddp.py", "--steps", "4")``: the ranks' report;
    ``gpus=True``: one process a GPU (otherwise CPU processes, even on a GPU machine)."""
    out = tmp_path / f"{Path(script).stem}.json"
    cmd = [sys.executable, *"-m torch.distributed.run --standalone --nproc-per-node 2".split()]
    env = dict(os.environ) if gpus else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd += [str(EXAMPLES / script), *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and [r["rank"] for r in result["ranks"]] == [0, 1]
    return result


def agree(result: dict) -> None:
    """The ranks ended with the same parameters (the same digest of their full values)."""
    digests = {r["digest"] for r in result["ranks"]}
    assert len(digests) == 1, f"the ranks' parameters differ: {result['ranks']}"
