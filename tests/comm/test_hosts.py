"""torchrun across two hosts for real (network namespaces, a shaped link: cgx2.testing.netlab),
two ranks each: the quantized allreduce equals its model; the hierarchical allreduce (the node
by shared memory), the cgx backend, DDP with CGX's hook on a compiled model and with a
Global-QSGD hook are identical on all four ranks; HSDP across the hosts, its blocks compiled,
keeps replicas equal; cgx2.bench times the node mesh beside the flat allreduce."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hosts_checks.py"
TRAIN = Path(__file__).resolve().parent / "scripts" / "hosts_train.py"


def _command(script: Path | str, port: int) -> list[str]:
    # Both hosts share the machine's hostname (which resolves to localhost), so torchrun is
    # told which host serves the rendezvous (is_host) and each host's address (--local-addr),
    # as on servers whose names do not resolve to their addresses.
    return [
        "bash",
        "-c",
        f"exec {sys.executable} -m torch.distributed.run --nnodes 2 --nproc-per-node 2 "
        f"--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:{port} --rdzv-id hosts "
        f"--rdzv-conf is_host=$((HOST == 0)) --local-addr $HOST_ADDR {script}",
    ]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(netlab, script: Path, rate: str = "1gbit", timeout: float = 240) -> list:
    with netlab.Lab(2, netlab.Link(rate)) as lab:
        return lab.run(_command(script, 29500 + os.getpid() % 1000), env=ENV, timeout=timeout)


@pytest.mark.slow
def test_four_ranks_on_two_hosts_agree(netlab):
    results = _torchrun(netlab, SCRIPT)
    output = "".join(r.stdout for r in results)
    assert [r.returncode for r in results] == [0, 0], output[-2000:] + results[0].stderr[-3000:]
    checks: dict[str, dict[int, str]] = {}
    # Two ranks a host print to one pipe: a line's newline may come after the next line.
    for rank, name, value in re.findall(r"CHECK (\d) (\w+) (True|False|\d+)", output):
        checks.setdefault(name, {})[int(rank)] = value
    for name, by_rank in checks.items():
        assert sorted(by_rank) == [0, 1, 2, 3], (name, by_rank)
        if name.endswith("_same"):
            assert len(set(by_rank.values())) == 1, (name, by_rank)
        elif name.endswith("_replica"):  # ranks r and r + 2 hold one shard on two hosts
            assert by_rank[0] == by_rank[2] and by_rank[1] == by_rank[3], (name, by_rank)
            assert by_rank[0] != by_rank[1]
        else:
            assert set(by_rank.values()) == {"True"}, (name, by_rank)
    assert {
        "allreduce_is_model",
        "hierarchical_digest_same",
        "backend_digest_same",
        "ddp_compiled_params_same",
        "gqsgd_params_same",
        "hsdp_replica",
        "spans_hosts",
        "node_on_shm",
        "mesh_choice_same",
        "backend_ddp_params_same",
    } <= set(checks)


@pytest.mark.slow
def test_a_host_killed_mid_training_makes_the_other_raise_within_the_timeout(netlab, tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    with netlab.Lab(2, netlab.Link("1gbit")) as lab, open(out, "w") as o, open(err, "w") as e:
        command = _command(TRAIN, 29500 + (os.getpid() + 7) % 1000)
        survivor = lab.popen(0, command, ENV, stdout=o, stderr=e)
        lab.popen(1, command, ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while out.read_text().count("STEP") < 10:  # training for real across the link
            assert survivor.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        assert lab.kill(1) >= 3  # the whole host: its agent and both ranks
        killed = time.monotonic()
        try:
            survivor.wait(timeout=10 + 50)  # the group's timeout, and torchrun's own teardown
        except subprocess.TimeoutExpired:
            os.killpg(survivor.pid, signal.SIGKILL)
            pytest.fail(
                "the surviving host's ranks hung after its peer host died: "
                + err.read_text()[-3000:]
            )
        elapsed = time.monotonic() - killed
    stderr = err.read_text()
    assert survivor.returncode != 0, stderr[-2000:]
    assert elapsed < 60, elapsed
    assert "cgx2" in stderr or "Connection" in stderr or "timed out" in stderr, stderr[-3000:]


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
# Eager: compiled DDP across the hosts is test_four_ranks_on_two_hosts_agree's.
EXAMPLE_ARGS = (
    "--steps 5 --text-bytes 100000 --device cpu --dim 64 --layers 1 --log-every 100 "
    "--hook standard_dithering"
).split()


@pytest.mark.slow
def test_the_training_example_across_hosts_trains_as_on_one_host(netlab, tmp_path):
    """examples/train_ddp.py with a Global-QSGD hook: torchrun across two hosts of
    two ranks gives the losses of the same four ranks on one host (integer sums: exact)."""
    across, alone = tmp_path / "across.json", tmp_path / "alone.json"
    port = 29500 + (os.getpid() + 13) % 1000
    with netlab.Lab(2, netlab.Link("1gbit")) as lab:
        command = _command(EXAMPLE, port)
        command[-1] += " " + " ".join([*EXAMPLE_ARGS, "--json", str(across)])
        results = lab.run(command, env=ENV, timeout=300)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    command = [*torchrun, "--master-port", str(port + 1), str(EXAMPLE), *EXAMPLE_ARGS]
    done = subprocess.run(
        [*command, "--json", str(alone)], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = (json.loads(path.read_text()) for path in (across, alone))
    assert a["world_size"] == b["world_size"] == 4
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    assert a["losses"][-1] < a["losses"][0]


@pytest.mark.slow
def test_the_benchmark_across_hosts_times_the_node_mesh_beside_the_flat_allreduce(netlab, tmp_path):
    """python -m cgx2.bench across two hosts of two ranks: gloo, the flat quantized allreduce
    and the node mesh's (plain inside a host, quantized between), in one table and JSON."""
    port = 29500 + (os.getpid() + 29) % 1000
    bench = f"-m cgx2.bench --sizes 1M --bits 4 --dtypes fp32 --iters 2 --warmup 1 --out {tmp_path}"
    command = _command(bench, port)
    # The route pinned: first-use timing across the hosts is hosts_checks.py's (mesh_choice).
    env = {**ENV, "CGX2_CROSSOVER_BYTES": "1M", "CGX2_NODE_MESH": "0"}
    with netlab.Lab(2, netlab.Link("10gbit")) as lab:
        results = lab.run(command, env=env, timeout=240)
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:]
    assert "hier vs flat" in results[0].stdout
    (path,) = tmp_path.glob("allreduce_*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["hier_ms"] > 0 and row["cgx2_ms"] > 0
    assert row["hier_vs_flat"] == pytest.approx(row["cgx2_ms"] / row["hier_ms"])
