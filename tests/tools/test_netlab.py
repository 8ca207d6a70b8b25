"""cgx2.testing.netlab: hosts that reach each other over links shaped to the rate asked for,
namespaces removed after success, failure, a signal, and after a run that was killed."""

import os
import signal
import subprocess
import sys
import time

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
