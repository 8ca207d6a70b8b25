"""examples/train_ddp.py: runs on 2 gloo processes, and 4-bit training tracks plain DDP. The
examples are told ``--device cpu``: on a GPU machine they would take the GPU (one process each,
under torchrun), and these tests are of the CPU runs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "train_ddp.py"


def _run(
    tmp_path: Path, bits: int, steps: int, mode: str = "hook", env: dict | None = None
) -> dict:
    out = tmp_path / f"bits{bits}_{mode}.json"
    args = f"--bits {bits} --steps {steps} --log-every 20 --mode {mode} --device cpu".split()
    cmd = [sys.executable, str(EXAMPLE), *args, "--json", str(out)]
    env = None if env is None else {**os.environ, **env}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{bits}-bit DDP ({mode}), 2 x cpu" in proc.stdout
    assert "step 1/" in proc.stderr  # progress on stderr,
    assert "\r" not in proc.stderr  # as plain lines into a pipe or a log file
    return json.loads(out.read_text())


@pytest.mark.slow
def test_four_bit_loss_within_3_percent_of_uncompressed(tmp_path):
    """Same seed, data and 40 AdamW steps: the final loss (mean of the last 10 steps) with
    cgx_hook at 4 bits is within 3% of plain DDP's, while sending over 6x fewer bytes. (Plain
    DDP on the cgx backend: tests/backend/test_backend.py, and the launch tests below.)"""
    plain = _run(tmp_path, 32, 40)
    assert plain["final_loss"] < 0.6 * plain["first_loss"]
    assert plain["bytes_sent"] is None
    four = _run(tmp_path, 4, 40, "hook")
    assert four["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-6)
    assert abs(four["final_loss"] - plain["final_loss"]) <= 0.03 * plain["final_loss"]
    assert four["bytes_uncompressed"] / four["bytes_sent"] > 6


@pytest.mark.slow
def test_compress_mode_is_the_hook_where_it_pays_and_ddps_own_elsewhere(tmp_path):
    """--mode compress (cgx2.ddp.compress): on CPU processes of one host, where every bucket
    pays, the same hook as --mode hook (the same losses and bytes, bit for bit); where no
    bucket pays (the crossover above the model), DDP's own allreduce: plain DDP's losses, bit
    for bit, every byte sent exact."""
    hook = _run(tmp_path, 4, 4, "hook")
    compressed = _run(tmp_path, 4, 4, "compress")
    assert compressed["losses"] == hook["losses"]
    assert compressed["bytes_sent"] == hook["bytes_sent"] < hook["bytes_uncompressed"]
    plain = _run(tmp_path, 32, 4, "hook")
    kept = _run(tmp_path, 4, 4, "compress", env={"CGX2_CROSSOVER_BYTES": str(1 << 40)})
    assert kept["losses"] == plain["losses"] != hook["losses"]
    assert kept["bytes_sent"] == kept["bytes_uncompressed"] == hook["bytes_uncompressed"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed")
def test_mpirun_launch_needs_no_setup(tmp_path):
    """CGX's way: `mpirun -np 2 python train.py` on the cgx backend, no RANK/MASTER_* set by
    the user."""
    out = tmp_path / "mpi.json"
    mpirun = "mpirun --allow-run-as-root --oversubscribe -np 2".split()
    args = "--steps 3 --mode backend --device cpu".split()
    cmd = [*mpirun, sys.executable, str(EXAMPLE), *args, "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["steps"] == 3
    assert result["mode"] == "backend" and 0 < result["bytes_sent"] < result["bytes_uncompressed"]


@pytest.mark.slow
def test_two_node_torchrun_on_one_machine(tmp_path):
    """`torchrun --nnodes 2` started twice (c10d rendezvous on 127.0.0.1): the example trains
    compressed across the two "nodes" on the cgx backend, one process each (the flat allreduce
    crosses them). The hook across hosts: tests/comm/test_hosts.py."""
    mode = "backend"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two_nodes.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    # Across nodes the backend would time where compression pays on this loopback: never.
    env["CGX2_CROSSOVER_BYTES"] = "0"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    rendezvous = f"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} --rdzv-id cgx2-test"
    args = f"--steps 3 --mode {mode} --amp bf16 --device cpu".split()
    cmd = [*torchrun, "--nproc-per-node", "1", *rendezvous.split(), str(EXAMPLE), *args]
    cmd += ["--json", str(out)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(cmd, env=env, **pipes) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["mode"] == mode
    assert result["args"]["amp"] == "bf16"  # autocast: fp32 gradients, compressed all the same
    assert 0 < result["bytes_sent"] < result["bytes_uncompressed"]


@pytest.mark.slow
def test_fsdp_example_runs_compressed(tmp_path):
    """examples/train_fsdp.py, tiny, on 2 CPU processes: FSDP2 with cgx2.fsdp.compress. What it
    says it sent counts the parameter all-gathers too, sent and uncompressed alike: FSDP2's own
    (as much traffic as the reduce-scatters), then cgx2's at 8 bits, then with the forward's
    gathered parameters kept for the backward."""
    results = {}
    for extra in ([], ["--param-bits", "8"], ["--param-bits", "8", "--keep-quantized-params"]):
        out = tmp_path / f"fsdp{len(extra)}.json"
        fsdp = [sys.executable, str(EXAMPLE.with_name("train_fsdp.py"))]
        model = "--bits 4 --dim 64 --layers 2 --heads 4 --context 64 --steps 6 --no-compile"
        cmd = [*fsdp, *model.split(), "--json", str(out), "--device", "cpu", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "4-bit FSDP2" in proc.stdout and ", 2 x cpu" in proc.stdout
        assert "(reduce-scatter and parameter all-gather)" in proc.stdout
        assert ("kept for the backward" in proc.stdout) == ("--keep-quantized-params" in extra)
        assert "step 1/6" in proc.stderr and "\r" not in proc.stderr
        results[len(extra)] = json.loads(out.read_text())
    plain_gather, eight = results[0], results[2]
    for r in (plain_gather, eight):
        assert r["tokens_per_s"] > 0 and r["final_loss"] < r["first_loss"]
        rs, ag = r["reduce_scatter_bytes_sent"], r["all_gather_bytes_sent"]
        assert r["bytes_sent"] == rs + ag and ag > 0
        assert r["bytes_uncompressed"] == (
            r["reduce_scatter_bytes_uncompressed"] + r["all_gather_bytes_uncompressed"]
        )
        assert r["reduce_scatter_bytes_uncompressed"] / rs > 5
        # Every parameter gathered once a step in forward, again in backward where it was
        # freed after forward (not the root's): (S-1)/S of the fp32 parameters, once to twice.
        once = 6 * r["params"] * 4 // 2
        assert once <= r["all_gather_bytes_uncompressed"] <= 2.1 * once
    assert plain_gather["all_gather_bytes_sent"] == plain_gather["all_gather_bytes_uncompressed"]
    assert eight["all_gather_bytes_uncompressed"] == plain_gather["all_gather_bytes_uncompressed"]
    assert 3 < eight["all_gather_bytes_uncompressed"] / eight["all_gather_bytes_sent"] < 4
    assert 1 < plain_gather["bytes_uncompressed"] / plain_gather["bytes_sent"] < 2.5
    assert eight["bytes_uncompressed"] / eight["bytes_sent"] > 3
    # Kept: the same training; the blocks' backward gathers (not the root's single one) sent
    # no bytes, counted uncompressed all the same.
    kept = results[3]
    assert kept["losses"] == eight["losses"]
    assert kept["all_gather_bytes_uncompressed"] == eight["all_gather_bytes_uncompressed"]
    assert 0.5 * eight["all_gather_bytes_sent"] < kept["all_gather_bytes_sent"]
    assert kept["all_gather_bytes_sent"] < 0.7 * eight["all_gather_bytes_sent"]


@pytest.mark.slow
def test_compare_hooks_writes_table_json_and_plot(tmp_path):
    """examples/compare_hooks.py at a tiny size: every hook trains, and the table, the JSON and
    the PNG plot are written."""
    model = "--steps 5 --dim 32 --layers 1 --heads 2 --context 32 --batch-size 8"
    cmd = [sys.executable, str(EXAMPLE.with_name("compare_hooks.py")), *model.split()]
    cmd += ["--out-dir", str(tmp_path), "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [json_path] = tmp_path.glob("compare_hooks_*.json")
    [png_path] = tmp_path.glob("compare_hooks_*.png")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = {r["hook"]: r for r in json.loads(json_path.read_text())["runs"]}
    assert len(runs) == 10 and "| cgx 4-bit |" in proc.stdout
    for r in runs.values():
        assert len(r["losses"]) == 5 and r["final_loss"] < r["losses"][0] + 1e-6
    # 5 steps, the first exact (CGXState's start_iter): 1 + 4/7.7 of plain's bytes at most
    assert runs["cgx 4-bit"]["bytes_sent"] * 3 < runs["plain (default_hook)"]["bytes_sent"]
    assert 0 < runs["L-GreCo PowerSGD"]["bytes_sent"] < runs["plain (default_hook)"]["bytes_sent"]


def test_help_says_byte_level_and_compare() -> None:
    """The help is the README's: a byte-level model; --compare is offered, and refused where
    it would compare plain DDP with itself."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "byte-level transformer" in text and "character-level" not in text
    assert "--compare train plain DDP first" in text
    cmd = [sys.executable, str(EXAMPLE), "--compare", "--bits", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--compare times a hook against plain DDP" in proc.stderr


@pytest.mark.slow
def test_compare_reports_time_against_plain_ddp(tmp_path):
    """--compare trains plain DDP and then the hook from the same seed in the same processes,
    and prints and records the ratio of their median step times."""
    out = tmp_path / "compare.json"
    model = "--dim 32 --layers 1 --heads 2 --context 32 --batch-size 4 --steps 4 --device cpu"
    cmd = [sys.executable, str(EXAMPLE), "--bits", "4", "--compare", *model.split()]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    plain = result["plain"]
    assert plain["first_loss"] == pytest.approx(result["first_loss"], rel=1e-6)  # same seed
    assert len(plain["losses"]) == len(result["losses"]) == 4
    assert result["speedup_vs_plain"] == pytest.approx(plain["step_ms"] / result["step_ms"])
    ratio = result["speedup_vs_plain"]
    assert f"plain ms / cgx2 ms = {ratio:.2f}" in proc.stdout
    said = f"{ratio:.2f}x as fast" if ratio >= 1 else f"{1 / ratio:.2f}x as slow"
    assert f"4-bit DDP was {said}" in proc.stdout
    assert 0 < result["bytes_sent"] < result["bytes_uncompressed"]


@pytest.mark.slow
def test_rotation_and_error_feedback_reach_the_hooks_state(tmp_path):
    """--rotation hadamard --error-feedback make the cgx hook's state rotate and keep residuals
    (as the state reports them), for 2 steps at 2 bits; other modes refuse them."""
    out = tmp_path / "rotated.json"
    model = "--dim 32 --layers 1 --heads 2 --context 32 --batch-size 4 --steps 2 --device cpu"
    flags = ["--bits", "2", "--rotation", "hadamard", "--error-feedback", *model.split()]
    cmd = [sys.executable, str(EXAMPLE), *flags, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rotation"] == "hadamard" and result["error_feedback"] is True
    assert len(result["losses"]) == 2 and 0 < result["bytes_sent"] < result["bytes_uncompressed"]
    cmd = [sys.executable, str(EXAMPLE), "--bits", "32", "--rotation", "hadamard"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--rotation and --error-feedback are the cgx hook's" in (
        proc.stderr
    )
