"""cgx2.testing.netlab: hosts that reach each other over links shaped to the rate asked for,
namespaces removed after success, failure, a signal, and after a run that was killed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Host 1 sends 2 MB to host 0 and prints how long the bytes took to cross.
TRANSFER = r"""
import os, socket, time
if os.environ["HOST"] == "0":
    s = socket.create_server((os.environ["HOST_ADDR"], 29311))
    c, _ = s.accept()
    got, start = 0, None
    while got < 2_000_000:
        data = c.recv(1 << 16)
        start = start or time.monotonic()
        got += len(data)
    print(f"seconds {time.monotonic() - start:.4f}")
    c.sendall(b"k")
else:
    for _ in range(100):
        try:
            c = socket.create_connection((os.environ["MASTER_ADDR"], 29311))
            break
        except OSError:
            time.sleep(0.05)
    c.sendall(b"x" * 2_000_000)
    c.recv(1)
"""


def _ours() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if f"-{os.getpid()}" in line]


def _seconds(netlab, rate: str, **link: str) -> float:
    with netlab.Lab(2, netlab.Link(rate, **link)) as lab:
        results = lab.run([sys.executable, "-c", TRANSFER], timeout=60)
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    return float(results[0].stdout.split()[1])


def test_hosts_reach_each_other_at_the_rate_of_their_link(netlab):
    slow, fast = _seconds(netlab, "40mbit"), _seconds(netlab, "2gbit")
    assert slow >= 0.8 * 2_000_000 * 8 / 40e6  # 0.4 s at 40 Mbit/s: shaped
    assert fast < slow / 5
    assert _ours() == []


def test_an_idle_link_sends_its_next_bytes_no_faster_than_its_rate(netlab):
    # 2 MB at 1 Gbit/s is 16 ms on a wire; a token bucket holding 20 ms lets them all through
    # unshaped after the connection's pause, the default (its 64 KiB floor) only that much.
    wire = 2_000_000 * 8 / 1e9
    assert _seconds(netlab, "1gbit") >= 0.85 * wire
    assert _seconds(netlab, "1gbit", burst="20ms") < 0.5 * wire
    assert netlab.Link("10gbit").burst_bytes() == 125_000  # 100 us at 10 Gbit/s
    assert netlab.Link("1gbit").burst_bytes() == 65536


def test_every_host_gets_its_address_and_the_lab_goes_away_on_an_error(netlab):
    with pytest.raises(RuntimeError, match="inside"):
        with netlab.Lab(3, netlab.Link("1gbit")) as lab:
            results = lab.run(["bash", "-c", "echo $HOST $HOST_ADDR $MASTER_ADDR $NHOSTS"])
            assert [r.stdout.split() for r in results] == [
                [str(i), f"10.78.0.{i + 1}", "10.78.0.1", "3"] for i in range(3)
            ]
            assert len(_ours()) == 4  # three hosts and the bridge's
            raise RuntimeError("inside")
    assert _ours() == []


def test_namespaces_of_a_killed_run_are_removed_by_the_next(netlab):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{netlab.PREFIX}0-{gone.pid}"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with netlab.Lab(1):
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in listed


def test_the_command_line_runs_a_command_in_each_host_and_cleans_up_on_a_signal(netlab):
    cli = [sys.executable, "-m", "cgx2.testing.netlab", "--hosts", "2", "--rate", "1gbit"]
    done = subprocess.run([*cli, "--", "bash", "-c", "exit $HOST"], capture_output=True, timeout=60)
    assert done.returncode == 1  # host 1's status
    running = subprocess.Popen([*cli, "--", "sleep", "60"])
    for _ in range(100):  # until its hosts exist (not its probe, made and deleted before them)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if f"{netlab.PREFIX}1-{running.pid}" in listed:
            break
        time.sleep(0.1)
    running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=30) != 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"-{running.pid}" not in listed


def test_a_delay_is_netems_or_a_clear_error(netlab):
    try:
        with netlab.Lab(2, netlab.Link("1gbit", delay="20ms")) as lab:
            results = lab.run([sys.executable, "-c", TRANSFER], timeout=60)
    except RuntimeError as e:
        assert "no netem" in str(e)  # this kernel's (gVisor's, some containers')
        assert _ours() == []
        return
    assert float(results[0].stdout.split()[1]) >= 0.02


def test_bad_links_are_refused():
    from cgx2.testing.netlab import Lab, Link

    for bad in (
        {"rate": "fast"},
        {"rate": "1gbit", "loss": 120},
        {"rate": "1gbit", "delay": "x"},
        {"rate": "1gbit", "burst": "5"},
    ):
        with pytest.raises(ValueError):
            Link(**bad)
    with pytest.raises(ValueError, match="hosts"):
        Lab(0)


def test_gpu_hosts_split_the_gpus_and_tell_nccl_they_are_hosts_apart():
    """No namespaces needed: what each host's command gets."""
    from cgx2.testing.netlab import IFNAME, Lab

    lab = Lab(2, gpus_per_host=2, gpus=4)
    envs = [lab.environment(h) for h in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
    assert [e["GPUS_PER_HOST"] for e in envs] == ["2", "2"]
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]  # NCCL's host hash: two hosts
    assert {e["NCCL_SOCKET_IFNAME"] for e in envs} == {IFNAME}  # the shaped link
    assert {e["NCCL_IB_DISABLE"] for e in envs} == {"1"}
    # four hosts of one GPU each, out of the caller's own list of devices
    gpus = ["3", "2", "GPU-a", "7"]
    four = Lab(4, gpus_per_host=1, gpus=gpus)
    assert [four.environment(h)["CUDA_VISIBLE_DEVICES"] for h in range(4)] == gpus
    assert len({four.environment(h)["NCCL_HOSTID"] for h in range(4)}) == 4
    # CPU hosts get none of it
    cpu = Lab(2).environment(1)
    assert not {"CUDA_VISIBLE_DEVICES", "NCCL_HOSTID", "NCCL_SOCKET_IFNAME"} & cpu.keys()


def test_gpu_hosts_take_the_callers_visible_devices(monkeypatch):
    from cgx2.testing.netlab import Lab

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    lab = Lab(2, gpus_per_host=2)
    assert [lab.environment(h)["CUDA_VISIBLE_DEVICES"] for h in range(2)] == ["4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,-1,2")  # CUDA stops at the first non-device
    with pytest.raises(ValueError, match=r"needs 2 GPUs; 1 is visible \(CUDA_VISIBLE_DEVICES"):
        Lab(2, gpus_per_host=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="needs 2 GPUs; 0 are visible"):
        Lab(2, gpus_per_host=1)


def test_gpu_hosts_refuse_bad_counts_with_a_clear_message():
    from cgx2.testing.netlab import Lab

    with pytest.raises(ValueError, match="gpus_per_host=2 with 2 hosts needs 4 GPUs; 2 are"):
        Lab(2, gpus_per_host=2, gpus=2)
    with pytest.raises(ValueError, match="gpus_per_host must be at least 1, got 0"):
        Lab(2, gpus_per_host=0, gpus=2)
    with pytest.raises(TypeError, match="gpus_per_host must be an int"):
        Lab(2, gpus_per_host=1.5, gpus=2)
    with pytest.raises(TypeError, match="gpus_per_host must be an int"):
        Lab(2, gpus_per_host=True, gpus=2)
    with pytest.raises(ValueError, match="needs gpus_per_host"):
        Lab(2, gpus=2)
    with pytest.raises(ValueError, match=r"host must be in 0\.\.1"):
        Lab(2, gpus_per_host=1, gpus=2).environment(2)


def test_the_command_line_refuses_gpu_hosts_it_cannot_give_before_making_any(capsys):
    from cgx2.testing.netlab import main

    with pytest.raises(SystemExit) as exit_:
        main(["--hosts", "4", "--gpus-per-host", "1", "--gpus", "2", "--", "true"])
    assert exit_.value.code == 2
    assert "gpus_per_host=1 with 4 hosts needs 4 GPUs; 2 are visible" in capsys.readouterr().err


def test_the_command_line_says_its_defaults(capsys):
    from cgx2.testing.netlab import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--hosts HOSTS how many hosts" in text and "(default: 2)" in text
    assert "--mtu MTU the hosts' interfaces' MTU, bytes (default: 1500)" in text
    assert "--gpus-per-host" in text


def test_gpu_hosts_run_with_their_devices_and_nccls_variables(netlab):
    hosts = "--hosts 2 --gpus-per-host 2 --gpus 4 --".split()
    cli = [sys.executable, "-m", "cgx2.testing.netlab", *hosts]
    show = "echo $HOST $CUDA_VISIBLE_DEVICES $NCCL_HOSTID $NCCL_SOCKET_IFNAME; ip -o link show"
    done = subprocess.run([*cli, "bash", "-c", show], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line[:2] in ("0 ", "1 "))
    assert [line.split()[:2] for line in lines] == [["0", "0,1"], ["1", "2,3"]]
    assert lines[0].split()[2] != lines[1].split()[2]
    assert {line.split()[3] for line in lines} == {"eth0"}
    assert done.stdout.count(" eth0@") == 2  # the interface NCCL is told is each host's own


def _nccl_hosts_dry(tmp_path: Path, **settings: str) -> subprocess.CompletedProcess:
    """bench/nccl_hosts.sh run dry on 4 fake GPUs with these settings, its results in
    ``tmp_path``; it must succeed."""
    script = Path(__file__).parents[2] / "bench" / "nccl_hosts.sh"
    env = {**os.environ, "DRY_RUN": "1", "NGPU": "4", "RESULTS_DIR": str(tmp_path), **settings}
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_the_nccl_hosts_stage_gives_each_layouts_hosts_their_gpus(netlab, tmp_path):
    """bench/nccl_hosts.sh, dry (fake GPUs, the commands echoed from inside each host): 4 GPUs
    make 2 hosts x 2 and 4 x 1, each host its own GPUs and NCCL host, HSDP only on 2 x 2."""
    done = _nccl_hosts_dry(tmp_path, NCCL_HOST_RATES="1gbit", NCCL_HOST_RUNS="bench hsdp_bf16_b4p8")
    hosts = [line.split() for line in done.stdout.splitlines() if line.startswith("host ")]
    seen = {(line[1], line[2], line[3], " ".join(line[4:])) for line in hosts}
    runs = [line.split()[1:4] for line in done.stdout.splitlines() if line.startswith("== ")]
    assert runs == [
        ["2x2", "1gbit", "bench"],
        ["4x1", "1gbit", "bench"],
        ["2x2", "1gbit", "hsdp_bf16_b4p8"],
    ]
    assert len(hosts) == 2 + 4 + 2
    for host, _, hostid, rest in seen:
        assert hostid == f"NCCL_HOSTID=cgx2n-host{host[:-1]}"
        assert "NCCL_SOCKET_IFNAME=eth0" in rest and "--node-rank " + host[:-1] in rest
    two_by_two = sorted(d for h, d, _, r in seen if "--nnodes 2" in r and "cgx2.bench" in r)
    assert two_by_two == ["CUDA_VISIBLE_DEVICES=0,1", "CUDA_VISIBLE_DEVICES=2,3"]
    four = sorted(d for h, d, _, r in seen if "--nnodes 4" in r)
    assert four == [f"CUDA_VISIBLE_DEVICES={i}" for i in range(4)]
    assert all("--replicas 2" in r and "--param-bits 8" in r for *_, r in seen if "train_fsdp" in r)
    [folder] = tmp_path.glob("nccl_hosts_dry-run_*")
    assert (folder / "summary.md").exists() and (folder / "machine.json").exists()


def test_an_nccl_hosts_plan_runs_in_its_order_one_host_without_the_lab(netlab, tmp_path):
    """NCCL_HOST_PLAN's items run in order; a one-host layout runs torchrun on the host itself
    (no namespace, its regime's NCCL variables, every GPU), CGX2_NODE_MESH forced per run."""
    plan = (
        "1x4 shm mlp_plain; 2x2 1gbit mlp_cgx4_flat; 1x4 nvlink mlp_compress;"
        " 1x4 nvlink mlp_cgx4+CGX2_CUDA_GRAPHS=0+CGX2_PIECE=x; 1x4 nvlink conv_cgx2-rot"
    )
    done = _nccl_hosts_dry(tmp_path, NCCL_HOST_PLAN=plan)
    runs = [line.split()[1:4] for line in done.stdout.splitlines() if line.startswith("== ")]
    assert runs == [
        ["1x4", "shm", "mlp_plain"],
        ["2x2", "1gbit", "mlp_cgx4_flat"],
        ["1x4", "nvlink", "mlp_compress"],
        ["1x4", "nvlink", "mlp_cgx4+CGX2_CUDA_GRAPHS=0+CGX2_PIECE=x"],
        ["1x4", "nvlink", "conv_cgx2-rot"],
    ]
    one_host = [line for line in done.stdout.splitlines() if line.startswith("host 0: timeout")]
    assert len(one_host) == 4
    assert "NCCL_P2P_DISABLE=1" in one_host[0] and "NCCL_P2P_DISABLE" not in one_host[1]
    # A variant: its run's program, with its variables set.
    assert "CGX2_CUDA_GRAPHS=0 CGX2_PIECE=x" in one_host[2] and "--name cgx4" in one_host[2]
    assert "examples/convergence.py" in one_host[3] and "--compressors cgx2-rot" in one_host[3]
    assert all(
        "CUDA_VISIBLE_DEVICES=0,1,2,3" in line and "--standalone" in line and "netlab" not in line
        for line in one_host
    )
    [folder] = tmp_path.glob("nccl_hosts_dry-run_*")
    recorded = (folder / "runs.jsonl").read_text()
    assert "CGX2_NODE_MESH=0" in recorded  # the flat run's command, as recorded


def test_the_nccl_hosts_summary_counts_each_hosts_link_and_the_steps_light():
    """What crossed each host's link is 2 (H - 1) / H of the allreduce's bytes (NVLink hops
    inside a host do not count); a step's light is the longer of its compute and its bytes."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    try:
        import nccl_hosts_summary as summary
    finally:
        sys.path.pop(0)
    bench = {
        "rows": [
            {"dtype": "fp32", "size": "256M", "bytes": 2**28, "plain_ms": 250.0, "plain_busbw": 1.6}
        ]
    }
    two = summary.delivered(bench, "10gbit", hosts=2)
    assert two["busbw_gbs"] == pytest.approx(2**28 / 0.25 / 1e9)
    assert two["of_rate"] == pytest.approx(2**28 / 0.25 * 8 / 1e10)
    four = summary.delivered(bench, "10gbit", hosts=4)
    assert four["busbw_gbs"] == pytest.approx(two["busbw_gbs"] * 1.5)
    assert summary.delivered(bench, "nvlink", hosts=1) is None
    run = {"compute_ms": 5.0, "params": 10**8, "hosts": "2", "gpus_per_host": "1"}
    wire_ms = 4e8 * 0.125 / (two["busbw_gbs"] * 1e9) * 1e3
    assert summary.light(run, 0.125, two, hosts=2) == pytest.approx(wire_ms)
    assert summary.light({**run, "compute_ms": 1e4}, 0.125, two, hosts=2) == 1e4
    assert summary.light({**run, "gpus_per_host": "2"}, 0.125, two, hosts=2) is None
    # DDP's light: the forward pass and the optimizer's step cannot overlap the bytes.
    assert summary.ddp_light(run, 0.125, two, hosts=2) is None  # phases not timed apart
    phased = {**run, "forward_ms": 2.0, "backward_ms": 3.0, "optimizer_ms": 1.5}
    assert summary.ddp_light(phased, 0.125, two, hosts=2) == pytest.approx(3.5 + wire_ms)
    slow_backward = {**phased, "backward_ms": 1e4}
    assert summary.ddp_light(slow_backward, 0.125, two, hosts=2) == pytest.approx(3.5 + 1e4)


def test_an_nccl_hosts_fsdp_run_named_k_keeps_the_quantized_parameters(netlab, tmp_path):
    """fsdp_*_b4p8k passes --keep-quantized-params with 8-bit parameters; b4p8 does not."""
    done = _nccl_hosts_dry(tmp_path, NCCL_HOST_PLAN="2x1 10gbit fsdp_fp32_b4p8 fsdp_bf16_b4p8k")
    lines = [ln for ln in done.stdout.splitlines() if "train_fsdp.py" in ln]
    kept = [ln for ln in lines if "--keep-quantized-params" in ln]
    assert kept and all("--param-bits 8" in ln and "--bf16" in ln for ln in kept), lines
    assert any("--param-bits 8 " in ln and ln not in kept for ln in lines), lines


def test_the_nccl_hosts_optimizer_in_backward_runs_pass_the_flag(netlab, tmp_path):
    """mlp_cgx4o is compress at 4 bits with --optimizer-in-backward, ddp_b4o train_ddp.py at 4
    bits with it; ddp_b4, mlp_compress and ddp_c4 (train_ddp.py's --mode compress) without."""
    plan = "1x4 nvlink mlp_cgx4o ddp_b4o ddp_b4 mlp_compress ddp_c4"
    done = _nccl_hosts_dry(tmp_path, NCCL_HOST_PLAN=plan)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("host 0:")]
    assert len(lines) == 5, done.stdout
    mlp, ddp, *without = lines
    assert "ddp_gloo_cuda.py --hook compress --bits 4 --optimizer-in-backward" in mlp
    assert "train_ddp.py" in ddp and "--bits 4 " in ddp and "--optimizer-in-backward" in ddp
    assert all("--optimizer-in-backward" not in ln for ln in without), without
    # ddp_c4: train_ddp.py through cgx2.ddp.compress; ddp_b4 registers the hook itself.
    assert "train_ddp.py --device cuda --bits 4 " in without[2] and "--mode compress" in without[2]
    assert "--mode" not in without[0]


def test_the_nccl_hosts_summary_shows_the_optimizer_in_backward_runs(tmp_path):
    """An optimizer stepping in the backward pass adds to its compute, not after it: DDP's
    light is forward + the longer of (backward + optimizer) and the bytes. mlp_cgx4o and
    ddp_b4o get rows of their own, ddp_b4o's beside plain DDP's eager run."""
    import json

    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    try:
        import nccl_hosts_summary as summary
    finally:
        sys.path.pop(0)
    two = {"busbw_gbs": 1.0}
    run = {"params": 10**8, "hosts": "2", "gpus_per_host": "1", "forward_ms": 2.0}
    wire_ms = 4e8 * 0.125 * 1 / 1e9 * 1e3  # 50 ms
    overlapped = {**run, "backward_ms": 3.0, "optimizer_ms": 0.0, "optimizer_in_backward_ms": 1.5}
    assert summary.ddp_light(overlapped, 0.125, two, hosts=2) == pytest.approx(2.0 + wire_ms)
    slow = {**overlapped, "backward_ms": 60.0}
    assert summary.ddp_light(slow, 0.125, two, hosts=2) == pytest.approx(2.0 + 61.5)

    folder = tmp_path / "2x1_10gbit"
    results = {
        "mlp_plain": {"median_ms": 400.0},
        "mlp_cgx4o": {"median_ms": 50.0, "bytes_sent_ratio": 0.13, **overlapped},
        "ddp_b32": {"step_ms": 300.0},
        "ddp_b4o": {"step_ms": 60.0},
    }
    for name, result in results.items():
        (folder / name).mkdir(parents=True)
        (folder / name / ("ddp_x.json" if name.startswith("mlp") else f"{name}.json")).write_text(
            json.dumps(result)
        )
    runs = {name: {"run": name, "rc": 0} for name in results}
    text, data = summary.section(folder, "2x1", "10gbit", runs)
    assert "| cgx2.ddp.compress 4-bit, AdamW in the backward pass | 50.0 | 8.00x |" in text, text
    assert "| eager, 4-bit with AdamW in the backward pass | 300.0 | 60.0 | 5.00x |" in text, text
    assert data["mlp"]["mlp_cgx4o"]["optimizer_in_backward_ms"] == 1.5


def test_nccl_hosts_rounds_repeat_the_plan_each_in_another_order(netlab, tmp_path):
    """NCCL_HOST_ROUNDS=3 runs the plan three times, each round's order the last one's turned
    by one; a round's run (NAME@r) runs NAME's program. A count that is not one is refused."""
    plan = "1x4 nvlink mlp_plain mlp_cgx4; 1x4 shm ddp_b4"
    done = _nccl_hosts_dry(tmp_path, NCCL_HOST_PLAN=plan, NCCL_HOST_ROUNDS="3")
    runs = [" ".join(line.split()[1:4]) for line in done.stdout.splitlines() if line[:3] == "== "]
    assert runs == [
        *("1x4 nvlink mlp_plain", "1x4 nvlink mlp_cgx4", "1x4 shm ddp_b4"),
        *("1x4 nvlink mlp_cgx4@2", "1x4 shm ddp_b4@2", "1x4 nvlink mlp_plain@2"),
        *("1x4 shm ddp_b4@3", "1x4 nvlink mlp_plain@3", "1x4 nvlink mlp_cgx4@3"),
    ]
    commands = [line for line in done.stdout.splitlines() if line.startswith("host 0:")]
    assert len(commands) == 9
    assert "--hook cgx --bits 4" in commands[3] and "/mlp_cgx4@2 " in commands[3] + " "
    assert "NCCL_P2P_DISABLE=1" in commands[4] and "train_ddp.py" in commands[4]
    script = Path(__file__).parents[2] / "bench" / "nccl_hosts.sh"
    for bad in ("0", "two"):
        refused = subprocess.run(
            ["bash", str(script)],
            env={
                **os.environ,
                "DRY_RUN": "1",
                "NGPU": "4",
                "NCCL_HOST_ROUNDS": bad,
                "RESULTS_DIR": str(tmp_path),
                "NCCL_HOST_PLAN": plan,
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 2 and f"not '{bad}'" in refused.stderr, refused.stderr


def test_the_nccl_hosts_summary_takes_the_median_of_a_runs_rounds(tmp_path):
    """A run timed in rounds (NAME, NAME@2, ...) counts by the median of its rounds, in the
    tables and their JSON; its rounds table gives each round's time and the spread. A round
    without a result (failed) is left out of the median."""
    import json

    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    try:
        import nccl_hosts_summary as summary
    finally:
        sys.path.pop(0)
    folder = tmp_path / "2x1_10gbit"
    results = {
        "mlp_plain": {"median_ms": 400.0, "params": 10},
        "mlp_plain@2": {"median_ms": 500.0, "params": 10},
        "mlp_cgx4": {"median_ms": 80.0, "bytes_sent_ratio": 0.125},
        "mlp_cgx4@2": {"median_ms": 70.0, "bytes_sent_ratio": 0.125},
        "mlp_cgx4@3": {"median_ms": 72.0, "bytes_sent_ratio": 0.125},
        "ddp_b32": {"step_ms": 480.0},
        "ddp_b4": {"step_ms": 90.0},
        "ddp_b4@2": None,  # failed: no JSON
        "ddp_b4@3": {"step_ms": 86.0},
    }
    for name, result in results.items():
        (folder / name).mkdir(parents=True)
        if result is not None:
            file = "ddp_x.json" if name.startswith("mlp") else f"{name.split('@')[0]}.json"
            (folder / name / file).write_text(json.dumps(result))
    runs = {name: {"run": name, "rc": 0 if results[name] else 1} for name in results}
    text, data = summary.section(folder, "2x1", "10gbit", runs)
    assert data["mlp"]["mlp_cgx4"]["median_ms"] == 72.0
    assert data["mlp"]["mlp_plain"]["median_ms"] == 450.0
    assert "| cgx_hook 4-bit | 72.0 | 6.25x | 0.125 |" in text, text
    assert data["train_ddp"]["eager"] == {"plain_ms": 480.0, "cgx4_ms": 88.0}
    assert "| mlp_cgx4 | 80.0, 70.0, 72.0 | 72.0 | 1.143 |" in text, text
    assert "| ddp_b4 | 90.0, -, 86.0 | 88.0 | 1.047 |" in text, text
    assert "| ddp_b32 |" not in text  # one round: no row
    # A variant of a train_ddp.py run, beside its run.
    (folder / "ddp_b4+CGX2_ALGORITHM=allgather").mkdir()
    (folder / "ddp_b4+CGX2_ALGORITHM=allgather" / "ddp_b4.json").write_text('{"step_ms": 80.0}')
    runs["ddp_b4+CGX2_ALGORITHM=allgather"] = {"rc": 0}
    text, _ = summary.section(folder, "2x1", "10gbit", runs)
    assert "| ddp_b4+CGX2_ALGORITHM=allgather | train_ddp.py step | 80.0 | 1.10x |" in text


def test_nccl_hosts_timelines_export_their_trace_where_asked(netlab, tmp_path):
    """TIMELINE_TRACE=1 gives the timeline runs (and only those) rank 0's chrome trace, in the
    run's folder."""
    plan = "1x4 nvlink timeline_mlp_b4o timeline_ddp_b4 mlp_plain"
    done = _nccl_hosts_dry(tmp_path, NCCL_HOST_PLAN=plan, TIMELINE_TRACE="1")
    mlp, ddp, plain = [ln for ln in done.stdout.splitlines() if ln.startswith("host 0:")]
    assert "/timeline_mlp_b4o --optimizer-in-backward --trace " in mlp
    assert mlp.rstrip().endswith("/timeline_mlp_b4o/trace.json"), mlp
    assert ddp.rstrip().endswith("/timeline_ddp_b4/trace.json") and "--trace" not in plain
    untraced = _nccl_hosts_dry(tmp_path, NCCL_HOST_PLAN=plan)
    assert "--trace" not in untraced.stdout
