"""Two hosts for real (network namespaces joined by a shaped veth pair, bench/hosts.sh), two
ranks each: the world group, which spans hosts, uses the process group; each node's group uses
shared memory; the hierarchical allreduce across them is identical on every rank."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "hosts_shm.py"


@pytest.mark.slow
def test_the_node_rides_shared_memory_and_the_world_does_not():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2 (ip, tc) to make network namespaces")
    port = 29500 + os.getpid() % 1000
    command = (f"torchrun --nnodes 2 --nproc-per-node 2 --node-rank $HOST "
               f"--master-addr $MASTER_ADDR --master-port {port} {SCRIPT}")  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "hosts.sh"), "--rate", "1gbit",
                           "--timeout", "240", "--", "bash", "-c", command],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # Four processes print to one pipe: lines may interleave, so find the reports anywhere.
    found = re.findall(r"rank (\d): world spans hosts=(\w+), node group on shm=(\w+), "
                       r"identical=(\w+)", done.stdout)  # fmt: skip
    assert sorted(rank for rank, *_ in found) == ["0", "1", "2", "3"], done.stdout
    assert all(row[1:] == ("True", "True", "True") for row in found), found
