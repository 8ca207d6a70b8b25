"""``cgx2``, ``python -m cgx2.bench`` and ``python -m cgx2.demo`` on a CPU machine without Triton
(what ``pip install -e .`` without extras gives): each runs in a subprocess where importing
``triton`` fails, as it does where it is not installed; the processes they start inherit that."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench_cli import _env, _free_port

# Put first on the path of every Python process of a test (the demo's spawned ranks and
# torchrun's included): a finder that refuses triton and its submodules as a missing module.
SITECUSTOMIZE = """
import sys


class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTriton())
"""


def _run(tmp_path: Path, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    hide = tmp_path / "no_triton"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = _env(
        TRITON_INTERPRET=None,
        CUDA_VISIBLE_DEVICES="",
        CGX2_CALIBRATION_FILE=str(tmp_path / "calibration.json"),
    )
    env["PYTHONPATH"] = f"{hide}:{env['PYTHONPATH']}"
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env=env,
    )


def test_triton_is_hidden(tmp_path: Path) -> None:
    """The test's own premise: in these subprocesses ``import triton`` fails."""
    proc = _run(tmp_path, ["-c", "import triton"])
    assert proc.returncode == 1
    assert "ModuleNotFoundError: No module named 'triton'" in proc.stderr


def test_import_cgx2(tmp_path: Path) -> None:
    code = "import sys, cgx2, torch; assert torch.ops.cgx.quantized_allreduce; print('ok')"
    proc = _run(tmp_path, ["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok\n"


@pytest.mark.parametrize(
    ("module", "says"),
    [
        (["cgx2.bench"], "usage: python -m cgx2.bench"),
        (["cgx2.bench", "calibrate"], "usage: python -m cgx2.bench calibrate"),
        (["cgx2.bench", "kernels"], "usage: python -m cgx2.bench kernels"),
        (["cgx2.demo"], "usage: python -m cgx2.demo"),
    ],
)
def test_help(tmp_path: Path, module: list[str], says: str) -> None:
    proc = _run(tmp_path, ["-m", *module, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(says)


def test_kernel_bench_says_it_needs_triton(tmp_path: Path) -> None:
    proc = _run(tmp_path, ["-m", "cgx2.bench", "kernels", "--numel", "4K"])
    assert proc.returncode == 2
    assert "Triton is not installed" in proc.stderr


@pytest.mark.slow
def test_demo_runs(tmp_path: Path) -> None:
    args = ["-m", "cgx2.demo", "--sizes", "64K", "--bits", "4", "--iters", "1"]
    proc = _run(tmp_path, [*args, "--json", str(tmp_path / "demo.json")])
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads((tmp_path / "demo.json").read_text())["rows"]
    assert row["identical"] is True and row["bytes"] == 64 << 10


@pytest.mark.slow
def test_bench_runs_under_torchrun(tmp_path: Path) -> None:
    launch = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
    ]
    bench = ["-m", "cgx2.bench", "--sizes", "64K", "--dtypes", "fp32", "--bits", "4"]
    proc = _run(tmp_path, [*launch, *bench, "--iters", "1", "--warmup", "0"])
    assert proc.returncode == 0, proc.stderr
    (path,) = (tmp_path / "cgx2-results").glob("allreduce_*.json")
    report = json.loads(path.read_text())
    assert report["env"]["triton"] is None
    (row,) = report["rows"]
    assert row["cgx2_ms"] > 0 and row["bytes"] == 64 << 10
