"""End-to-end checks of ``python -m cgx2.bench``: the kernel timing (under Triton's interpreter,
and its refusal without CUDA), the allreduce bench on two gloo ranks, each as a subprocess, its
refusal of one process, and the command-line conventions (sizes, --help, progress lines)."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cgx2.bench.report import Progress, parse_sizes

ROOT = Path(__file__).resolve().parents[2]
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


def _run(
    command: list[str], cwd: Path | None = None, timeout: int = 120, **env: str | None
) -> subprocess.CompletedProcess:
    """``command`` run to its end in ``cwd``, its output captured as text, with :func:`_env`'s
    environment and ``env``'s overrides."""
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=_env(**env)
    )


def _torchrun(args: list[str], cwd: Path, **env: str | None) -> subprocess.CompletedProcess:
    """:func:`_run` of ``args`` under torchrun: two processes, on a free local port."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launch += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    return _run([*launch, *args], cwd, timeout=300, **env)


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
    kernels = "kernels --numel 8192 --bits 4 --dtypes fp32".split()
    cmd = [sys.executable, "-m", "cgx2.bench", *kernels]
    proc = _run([*cmd, "--out", str(out)], tmp_path, timeout=300, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr
    assert KERNELS_HEADER in proc.stdout.splitlines()
    assert "time encode" in proc.stderr  # progress goes to stderr, not into the table

    report = _one_json(out, "kernels")  # rewritten as rows came: one file, complete at the end
    assert set(report) >= {"env", "args", "rows"} and report["complete"] is True
    assert report["env"]["world_size"] == 1 and report["env"]["triton"]
    assert report["args"]["numel"] == 8192 and report["args"]["bits"] == [4]
    rows = {(r["op"].split("(")[0], r["dtype"], r["bits"]): r for r in report["rows"]}
    for op in ("encode", "decode", "dse"):  # (bf16's kernels: tests/codecs; interpreted here,
        row = rows[(op, "fp32", 4)]  # each would cost seconds)
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
    proc = _run(
        [sys.executable, "-m", "cgx2.bench", *args, "--out", str(tmp_path / "out")],
        tmp_path,
        TRITON_INTERPRET=None,
        CUDA_VISIBLE_DEVICES="",
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


@pytest.mark.parametrize("command", [[], ["allreduce"], ["calibrate"]])
def test_one_process_is_refused(tmp_path: Path, command: list[str]) -> None:
    """Without torchrun (one process) the bench would time nothing but a copy: it says how to
    start it, exits 2 and writes nothing."""
    proc = _run(
        [sys.executable, "-m", "cgx2.bench", *command, "--sizes", "64K"],
        tmp_path,
        CUDA_VISIBLE_DEVICES="",
        RANK=None,
        WORLD_SIZE=None,
        LOCAL_WORLD_SIZE=None,
        CGX2_CALIBRATION_FILE=str(tmp_path / "calibration.json"),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "this is one process" in proc.stderr
    assert "torchrun --nproc-per-node 2 -m cgx2.bench" in proc.stderr
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [[], ["kernels"], ["calibrate"]])
def test_help_states_units_and_defaults_without_markup(command: list[str]) -> None:
    proc = _run([sys.executable, "-m", "cgx2.bench", *command, "--help"])
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "``" not in text and ":func:" not in text and ":mod:" not in text
    assert "--warmup WARMUP untimed" in text or command == ["kernels"]
    assert "(default: 2)" in text or "(default: 3)" in text or command == ["kernels"]
    assert "(default: 2,4,8)" in text or command == ["calibrate"]
    out_default = "calibration.json)" if command == ["calibrate"] else "(default: cgx2-results)"
    assert out_default in text
    if command != ["kernels"]:
        assert "in bytes; K, M, G mean KiB, MiB, GiB" in text


def test_sizes_are_bytes_with_binary_suffixes() -> None:
    from cgx2.bench.allreduce import parse_args

    assert parse_sizes("65536, 64K,1M,2G,3MiB") == [65536, 65536, 1 << 20, 2 << 30, 3 << 20]
    assert parse_args(["--sizes", "1M,4K"]).sizes == [1 << 20, 4 << 10]
    assert parse_args([]).sizes == [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
    for bad in ("0", "1.5M", "64X", ""):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--sizes", bad])
        assert exc.value.code == 2


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_flags_set_only_what_they_name_the_variables_the_rest(monkeypatch) -> None:
    """CGX2_PIPELINE_BYTES (and the other variables) reach the benchmark unless a flag names
    the same setting."""
    from cgx2 import config
    from cgx2.bench.allreduce import parse_args, settings_from_flags

    assert settings_from_flags(parse_args([])) == {}
    flags = ["--pipeline-mb", "8", "--no-pair-gather", "--no-direct-launch"]
    assert settings_from_flags(parse_args(flags)) == {
        "pipeline_bytes": 8 << 20,
        "pair_gather": False,
        "direct_launch": False,
    }
    monkeypatch.setenv("CGX2_PIPELINE_BYTES", "4M")
    config.reload()
    try:
        with config.tuned(**settings_from_flags(parse_args([]))):
            assert config.tuning().pipeline_bytes == 4 << 20
    finally:
        monkeypatch.delenv("CGX2_PIPELINE_BYTES")
        config.reload()


def test_progress_is_plain_lines_off_a_terminal() -> None:
    log = io.StringIO()
    progress = Progress(log)
    progress("step 1/3")
    progress("step 3/3")
    progress.close()
    assert log.getvalue() == "step 1/3\nstep 3/3\n"

    tty = _Terminal()
    progress = Progress(tty)
    progress("step 10/30")
    progress("step 30/30")
    progress.close()
    assert tty.getvalue() == "\rstep 10/30\rstep 30/30\n"


@pytest.mark.slow
def test_allreduce_bench_under_torchrun(tmp_path: Path) -> None:
    bench = ["-m", "cgx2.bench", "--sizes", "64K", "--dtypes", "fp32", "--bits", "4"]
    bench += ["--iters", "1", "--warmup", "0", "--calls", "3"]
    proc = _torchrun(bench, tmp_path, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header_at = next(i for i, line in enumerate(lines) if "speedup vs gloo" in line)
    headers = re.split(r"\s{2,}", lines[header_at].strip())
    assert headers[:5] == ["dtype", "size", "bits", "gloo ms", "gloo GB/s"]
    assert lines[header_at + 2].split()[:3] == ["fp32", "64K", "4"]
    # A legend under the table explains every column, in the table's order.
    legend_at = lines.index("Columns:")
    legend = [
        line.split(":")[0].strip()
        for line in lines[legend_at + 1 :]
        if line.startswith("  ") and not line.startswith("   ")
    ]
    assert legend == headers
    text = " ".join(proc.stdout.split())
    assert "SoL ms: speed of light:" in text and "with no encoding or decoding" in text
    assert "speedup vs gloo: gloo ms / cgx2 ms: above 1, cgx2 is faster" in text
    assert "auto: the path cgx2.quantized_allreduce_" in text
    assert lines[-2].endswith("3 calls back to back per timed window")
    assert "fp32 64K 4-bit\n" in proc.stderr and "\r" not in proc.stderr  # plain progress lines

    # The JSON goes to ./cgx2-results by default, and its path is the last line.
    (path,) = (tmp_path / "cgx2-results").glob("allreduce_*.json")
    assert lines[-1] == f"results: {path.relative_to(tmp_path)}"
    report = json.loads(path.read_text())
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
    assert row["speedup_vs_plain"] == pytest.approx(row["plain_ms"] / row["cgx2_ms"])


def test_results_across_netlab_hosts_name_their_link(tmp_path: Path, monkeypatch) -> None:
    import torch

    from cgx2.bench import report

    monkeypatch.setenv("LINK_RATE", "1gbit")
    monkeypatch.setenv("LINK_BURST", "100us")
    monkeypatch.setenv("NHOSTS", "2")
    env = report.environment(torch.device("cpu"), 2)
    assert env["link"] == {"rate": "1gbit", "burst": "100us", "hosts": 2, "driver": ""}
    path = report.write_json("allreduce", {"env": env, "rows": []}, tmp_path)
    assert "_cpu-1gbit-h2_w2_" in path.name
    monkeypatch.delenv("LINK_RATE")
    assert "link" not in report.environment(torch.device("cpu"), 2)


def test_host_cost_ab_tables_each_tree_over_the_first_round_by_round(tmp_path: Path) -> None:
    """bench/host_cost_ab.sh runs bench/host_cost.py and (2 gloo processes, without GPUs)
    bench/allreduce_host_cost.py under each tree, rounds alternating; each call's row holds the
    median over rounds of its host time over the first tree's in the same round, each round's
    ratio, and each tree's own µs and ratio to its clone / plain allreduce; the JSON beside the
    runs holds the rows and how they were made."""
    root = Path(__file__).parents[2]
    env = {
        **_env(),
        "TREES": f"a={root} b={root}",
        "ROUNDS": "2",
        "OUT": str(tmp_path),
        "HOST_COST_ARGS": "--numel 256 --calls 10 --rounds 1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    done = subprocess.run(
        ["bash", str(root / "bench" / "host_cost_ab.sh")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    header = "| call | b/a | a µs | b µs | a x_clone | b x_clone |"
    assert header in done.stdout, done.stdout
    assert "| call | b/a | a µs | b µs | a x_plain | b x_plain |" in done.stdout, done.stdout
    (path,) = tmp_path.glob("host_cost_ab_*.json")
    record = json.loads(path.read_text())
    assert record["env"]["command"].endswith("bash bench/host_cost_ab.sh")
    assert record["env"]["trees"]["a"]["path"] == str(root)
    kinds = (
        ("host_cost", "x_clone", "op_quantize"),
        ("allreduce_host_cost", "x_plain", "collectives.allreduce"),
    )
    for kind, ratio, timed in kinds:
        us = {  # (tree, round) -> call -> µs
            (tree, int(run.parent.name)): {
                row["call"]: row["host_us"] for row in json.loads(run.read_text())["rows"]
            }
            for tree in "ab"
            for run in tmp_path.glob(f"{tree}/*/{kind}_*.json")
        }
        assert sorted(us) == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
        rows = {row["call"]: row for row in record["tables"][kind]}
        table = done.stdout.split(f"\n{kind} on ")[1].split("\n\n")[0].splitlines()
        assert {"clone", timed} <= rows.keys()
        for call, row in rows.items():
            each = [us["b", r][call] / us["a", r][call] for r in (1, 2)]
            assert row["b/a_rounds"] == pytest.approx(each)
            assert row["b/a"] == pytest.approx(sum(each) / 2)
            assert row["a_us"] == pytest.approx((us["a", 1][call] + us["a", 2][call]) / 2)
            assert row[f"b_{ratio}"] > 0
            line = next(ln for ln in table if ln.startswith(f"| {call} |"))
            assert f"{row['b/a']:.3f} [{each[0]:.3f}, {each[1]:.3f}]" in line
