"""End-to-end checks of ``python -m cgx2.bench``: the kernel timing (under Triton's interpreter,
and its refusal without CUDA) and the allreduce bench on two gloo ranks, each as a subprocess."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS_HEADER = "op            dtype bits       ms  MB moved    GB/s  copyGB/s  %copy"


def _env(**overrides: str | None) -> dict[str, str]:
    """This process's environment with ``overrides`` (None removes a variable); the repo root
    goes first on PYTHONPATH so ``cgx2`` imports without installing."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_json(out_dir: Path, kind: str) -> dict:
    (path,) = out_dir.glob(f"{kind}_*.json")
    return json.loads(path.read_text())


STRIDED_LOOP = """
import torch, triton, triton.language as tl

@triton.jit
def strided(x, n):
    for t in range(tl.program_id(0), n, tl.num_programs(0)):
        tl.store(x + t, t)

x = torch.zeros(5, dtype=torch.int32)
strided[(2,)](x, 5)
assert x.tolist() == [0, 1, 2, 3, 4]
"""


def _interpreter_walks_strided_loops(tmp_path: Path) -> bool:
    """Whether this Triton's interpreter runs a loop from the program id, as the kernels do.
    Triton 3.6's did not under numpy 2: it took int() of a one-element array. Any other
    failure counts as walking them, so that the test below fails and shows it."""
    probe = tmp_path / "strided.py"
    probe.write_text(STRIDED_LOOP)
    env = _env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True)
    return proc.returncode == 0 or "only 0-dimensional arrays" not in proc.stderr


@pytest.mark.slow
def test_kernels_interpreted_on_cpu(tmp_path: Path) -> None:
    if not _interpreter_walks_strided_loops(tmp_path):
        pytest.skip("this Triton's interpreter cannot run a loop from the program id")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "cgx2.bench", "kernels", "--numel", "8192", "--bits", "4"]
    proc = subprocess.run(
        [*cmd, "--out-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_env(TRITON_INTERPRET="1"),
    )
    assert proc.returncode == 0, proc.stderr
    assert KERNELS_HEADER in proc.stdout.splitlines()
    assert "time encode" in proc.stderr  # progress goes to stderr, not into the table

    report = _one_json(out, "kernels")
    assert set(report) >= {"env", "args", "rows"}
    assert report["env"]["world_size"] == 1 and report["env"]["triton"]
    assert report["args"]["numel"] == 8192 and report["args"]["bits"] == [4]
    rows = {(r["op"].split("(")[0], r["dtype"], r["bits"]): r for r in report["rows"]}
    for dtype in ("fp32", "bf16"):
        for op in ("encode", "decode", "dse"):
            row = rows[(op, dtype, 4)]
            assert row["ms"] > 0 and row["copy_ms"] > 0 and row["bucket"] == 512
            assert row["bytes_moved"] == row["bytes_read"] + row["bytes_written"] > 0
    assert rows[("encode", "fp32", 4)]["numel"] == 8192
    assert rows[("dse", "fp32", 4)]["numel"] == 8192 // 4  # one of K = 4 chunks
    assert rows[("copy", "u8", 0)]["bytes_moved"] == 2 * 8192 * 4


@pytest.mark.parametrize(
    ("args", "message"),
    [(["kernels"], "CUDA"), (["--cuda-graphs"], "--cuda-graphs needs CUDA")],
)
def test_gpu_only_runs_refuse_without_cuda(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cgx2.bench", *args, "--out-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=_env(TRITON_INTERPRET=None, CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [["--calls", "0"], ["--iters", "0"]])
def test_allreduce_bench_refuses_empty_windows(args: list[str]) -> None:
    from cgx2.bench.allreduce import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(args)
    assert exc.value.code == 2


@pytest.mark.slow
def test_allreduce_bench_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "out"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launch += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    bench = ["-m", "cgx2.bench", "--sizes", "64K", "--dtypes", "fp32", "--bits", "4"]
    bench += ["--iters", "1", "--warmup", "0", "--calls", "3", "--out-dir", str(out)]
    proc = subprocess.run(
        [*launch, *bench],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_env(CUDA_VISIBLE_DEVICES=""),
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header_at = next(i for i, line in enumerate(lines) if "cgx2/plain x" in line)
    assert lines[header_at].split()[:3] == ["dtype", "size", "bits"]
    assert lines[header_at + 2].split()[:3] == ["fp32", "64K", "4"]
    assert lines[-2].endswith("3 calls back to back per timed window")

    report = _one_json(out, "allreduce")
    env = report["env"]
    assert env["regime"] == "cpu" and env["world_size"] == 2
    # The command starts with the NCCL and CGX variables in force (none on CI; NCCL_NVLS_ENABLE=0
    # on our GPU machines), each as it was set.
    assignments = re.match(r"((\w+)=(\S*) )*", env["command"]).group(0)
    for name, value in re.findall(r"(\w+)=(\S*) ", assignments):
        assert os.environ.get(name) == value
    launch = env["command"][len(assignments) :]
    assert launch.startswith("torchrun --nproc-per-node 2 -m cgx2.bench")
    assert "--calls 3" in env["command"] and report["args"]["calls"] == 3
    assert env["launcher"] == "torchrun"
    (row,) = report["rows"]
    assert (row["dtype"], row["bytes"], row["bits"]) == ("fp32", 64 * 1024, 4)
    assert row["plain_ms"] > 0 and row["cgx2_ms"] > 0 and row["sol_ms"] > 0
