"""Hosts on one machine: Linux network namespaces joined through a bridge, each host's link
shaped with tc (rate, delay, loss), and a command run in each: multi-node runs for real.

Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says why not where it cannot run.
The bridge lives in a namespace of its own and every address is private to the namespaces,
so nothing outside them changes. A lab removes its namespaces when it ends (success, error,
Ctrl-C, SIGTERM); namespaces left by a run that was killed are removed by the next.

    python -m cgx2.testing.netlab --hosts 2 --rate 1gbit -- bash -c \\
        'torchrun --nnodes 2 --nproc-per-node 2 --node-rank $HOST \\
         --master-addr $MASTER_ADDR --master-port 29500 train.py'

With ``--gpus-per-host N`` host h gets GPUs h·N … h·N+N−1 and NCCL sees distinct hosts joined
by the shaped link (:meth:`Lab.environment` says how).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Lab", "Link", "unavailable"]

log = logging.getLogger("cgx2")

PREFIX = "cgx2n"
"""Namespaces are ``cgx2n<host>-<pid>`` and ``cgx2nsw-<pid>`` (the bridge's)."""
NETWORK = "10.78.0"
"""A /24 used only inside the namespaces: host i is ``10.78.0.(i + 1)``."""
IFNAME = "eth0"
"""Each host's interface, as on a server: ``GLOO_SOCKET_IFNAME`` names it."""
_RATE = re.compile(r"^(\d+)(bit|kbit|mbit|gbit)$")
_TIME = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")


@dataclass(frozen=True)
class Link:
    """Each host's link to the bridge, shaped alike both ways.

    - ``rate``: tc's rate (``1gbit``, ``500mbit``, ...), kept by a token bucket (``tbf``).
    - ``burst``: the bucket's size, as time at the rate (at least 64 KiB, one GSO packet). A
      link idle that long sends its next bytes unshaped, which a wire does not: the smaller,
      the truer a call that follows a pause is timed, as long as the host's timers keep the
      rate.
    - ``delay``: netem's one-way delay (``"1ms"``), or None.
    - ``loss``: netem's loss in percent, or None.
    - ``mtu``: the interfaces' MTU.
    """

    rate: str = "10gbit"
    burst: str = "100us"
    delay: str | None = None
    loss: float | None = None
    mtu: int = 1500

    def __post_init__(self) -> None:
        if not _RATE.match(self.rate):
            raise ValueError(f"rate {self.rate!r}: an integer with bit, kbit, mbit or gbit")
        if self.loss is not None and not 0 <= self.loss < 100:
            raise ValueError(f"loss {self.loss!r}: a percentage in [0, 100)")
        for name in ("delay", "burst"):
            value = getattr(self, name)
            if value is not None and not _TIME.match(value):
                raise ValueError(f"{name} {value!r}: like 500us, 1ms or 0.1s")

    def burst_bytes(self) -> int:
        number, unit = _TIME.match(self.burst).groups()  # type: ignore[union-attr]
        seconds = float(number) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
        return max(round(self.bits_per_second() * seconds / 8), 65536)

    def bits_per_second(self) -> int:
        number, unit = _RATE.match(self.rate).groups()  # type: ignore[union-attr]
        return int(number) * {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[unit]


@dataclass
class Lab:
    """``hosts`` namespaces behind one bridge, made on entering, removed on leaving::

        with Lab(2, Link("1gbit")) as lab:
            results = lab.run(["python", "-c", "print(1)"])

    ``iproute_root``: where ``dpkg -x`` unpacked iproute2 and its libraries, on an image
    without ``ip`` (else from PATH).

    ``gpus_per_host``: GPU hosts, N GPUs each: host h gets the GPUs h·N … h·N+N−1 of ``gpus``
    (the devices to split: a count, or their ``CUDA_VISIBLE_DEVICES`` entries; by default this
    process's ``CUDA_VISIBLE_DEVICES``, else what ``nvidia-smi -L`` lists, else unknown and
    not checked). Nothing here imports torch or needs a GPU.
    """

    hosts: int
    link: Link = field(default_factory=Link)
    iproute_root: str | None = None
    gpus_per_host: int | None = None
    gpus: int | Sequence[str] | None = None
    names: list[str] = field(default_factory=list, init=False)
    _switch: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"hosts must be in 1..200, got {self.hosts}")
        self._devices = self._split_gpus()
        self._ip, self._tc, self._tool_env = _tools(self.iproute_root)

    def _split_gpus(self) -> list[str] | None:
        """Each host's ``CUDA_VISIBLE_DEVICES`` entries, or None without GPU hosts."""
        n = self.gpus_per_host
        if n is None:
            if self.gpus is not None:
                raise ValueError(
                    "gpus names the GPUs to split among the hosts: it needs gpus_per_host"
                )
            return None
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"gpus_per_host must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"gpus_per_host must be at least 1, got {n}")
        if isinstance(self.gpus, bool):
            raise TypeError("gpus must be a count or a list of CUDA_VISIBLE_DEVICES entries")
        if isinstance(self.gpus, int):
            if self.gpus < 0:
                raise ValueError(f"gpus must be a count >= 0, got {self.gpus}")
            devices, source = [str(i) for i in range(self.gpus)], f"gpus={self.gpus}"
        elif self.gpus is not None:
            devices = [str(d).strip() for d in self.gpus]
            if any(not d or "," in d for d in devices):
                raise ValueError(f"gpus: one device a entry, none empty, got {list(self.gpus)}")
            source = f"gpus={devices}"
        else:
            devices, source = visible_gpus()
        need = self.hosts * n
        if devices is None:  # no way to count them here: host h gets indices h·N … h·N+N−1
            return [",".join(str(h * n + i) for i in range(n)) for h in range(self.hosts)]
        if need > len(devices):
            raise ValueError(
                f"gpus_per_host={n} with {self.hosts} hosts needs {need} GPUs; "
                f"{len(devices)} {'is' if len(devices) == 1 else 'are'} visible ({source})"
            )
        return [",".join(devices[h * n : (h + 1) * n]) for h in range(self.hosts)]

    # -- addresses --------------------------------------------------------------------------

    def address(self, host: int) -> str:
        """Host ``host``'s address (only inside the namespaces)."""
        return f"{NETWORK}.{host + 1}"

    def environment(self, host: int) -> dict[str, str]:
        """What a command in host ``host`` gets: HOST, NHOSTS, HOST_ADDR, MASTER_ADDR (host
        0's), GLOO_SOCKET_IFNAME, LINK_RATE and LINK_BURST; on GPU hosts (``gpus_per_host``)
        also GPUS_PER_HOST, CUDA_VISIBLE_DEVICES (the host's GPUs), NCCL_HOSTID (the host's
        own: NCCL takes ranks with one host hash for one machine and joins them by P2P or
        shared memory, which would bypass the link; the namespaces share the machine's), and
        NCCL_SOCKET_IFNAME with NCCL_IB_DISABLE=1 (NCCL's sockets over the host's shaped
        interface: not loopback, nor an RDMA NIC, which every namespace sees)."""
        if not 0 <= host < self.hosts:
            raise ValueError(f"host must be in 0..{self.hosts - 1}, got {host}")
        env = {
            "HOST": str(host),
            "NHOSTS": str(self.hosts),
            "HOST_ADDR": self.address(host),
            "MASTER_ADDR": self.address(0),
            "GLOO_SOCKET_IFNAME": IFNAME,
            "LINK_RATE": self.link.rate,
            "LINK_BURST": self.link.burst,
        }
        if self._devices is not None:
            env |= {
                "GPUS_PER_HOST": str(self.gpus_per_host),
                "CUDA_VISIBLE_DEVICES": self._devices[host],
                "NCCL_HOSTID": f"{PREFIX}-host{host}",
                "NCCL_SOCKET_IFNAME": IFNAME,
                "NCCL_IB_DISABLE": "1",
            }
        return env

    # -- life ---------------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        remove_stale(self.iproute_root)
        pid = os.getpid()
        self._switch = f"{PREFIX}sw-{pid}"
        self.names = [f"{PREFIX}{i}-{pid}" for i in range(self.hosts)]
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        ip = self._run_ip
        ip("netns", "add", self._switch)
        ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self._switch, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            ip("netns", "add", name)
            port = f"p{i}"
            ip(
                "-n",
                name,
                "link",
                "add",
                IFNAME,
                "mtu",
                str(self.link.mtu),
                "type",
                "veth",
                "peer",
                "name",
                port,
                "mtu",
                str(self.link.mtu),
                "netns",
                self._switch,
            )
            ip("-n", self._switch, "link", "set", port, "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            ip("-n", name, "link", "set", IFNAME, "up")
            ip("-n", name, "link", "set", "lo", "up")
            self._shape(name, IFNAME)  # the host's sending
            self._shape(self._switch, port)  # its receiving

    def _shape(self, namespace: str, device: str) -> None:
        tbf = [
            "tbf",
            "rate",
            self.link.rate,
            "burst",
            str(self.link.burst_bytes()),
            "latency",
            "100ms",
        ]
        if self.link.delay is None and self.link.loss is None:
            self._run_tc("-n", namespace, "qdisc", "add", "dev", device, "root", *tbf)
            return
        netem = ["netem"]
        if self.link.delay is not None:
            netem += ["delay", self.link.delay]
        if self.link.loss is not None:
            netem += ["loss", f"{self.link.loss}%"]
        try:
            self._run_tc(
                "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", *netem
            )
        except RuntimeError as e:
            if "kind is unknown" in str(e):
                raise RuntimeError(
                    "cgx2.netlab: this kernel has no netem (sch_netem): a link's "
                    "delay and loss need it; its rate does not"
                ) from e
            raise
        self._run_tc(
            "-n", namespace, "qdisc", "add", "dev", device, "parent", "1:", "handle", "2:", *tbf
        )

    def close(self) -> None:
        """Kill whatever still runs in the namespaces and remove them (idempotent)."""
        for name in [*self.names, self._switch]:
            if name:
                _remove(name, self._ip, self._tool_env)
        self.names, self._switch = [], ""

    # -- commands -----------------------------------------------------------------------------

    def kill(self, host: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to every process in host ``host`` (a host that dies: torchrun's
        workers too, which run in sessions of their own). Returns how many got it."""
        pids = subprocess.run(
            [self._ip, "netns", "pids", self.names[host]],
            env=self._tool_env,
            capture_output=True,
            text=True,
        )
        sent = 0
        for pid in pids.stdout.split():
            try:
                os.kill(int(pid), sig)
                sent += 1
            except (ProcessLookupError, ValueError):
                pass
        return sent

    def popen(
        self,
        host: int,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen:
        """Start ``command`` in host ``host`` with :meth:`environment` added to ``env`` (default:
        this process's), in a process group of its own."""
        full = {**(os.environ if env is None else env), **self.environment(host)}
        prefix = [self._ip, "netns", "exec", self.names[host]]
        if self.iproute_root:  # ip runs with its own libraries, the command with the caller's
            prefix += ["env", f"LD_LIBRARY_PATH={full.get('LD_LIBRARY_PATH', '')}"]
            full = {**full, "LD_LIBRARY_PATH": self._tool_env["LD_LIBRARY_PATH"]}
        return subprocess.Popen([*prefix, *command], env=full, start_new_session=True, **kwargs)  # type: ignore[arg-type]

    def run(
        self,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> list[subprocess.CompletedProcess]:
        """``command`` in every host at once; each one's exit status and output (stdout and
        stderr, text). Past ``timeout`` seconds, every command still running is killed and
        reports -9."""
        procs = [
            self.popen(i, command, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(self.hosts)
        ]
        deadline = None if timeout is None else time.monotonic() + timeout
        results = []
        try:
            for proc in procs:
                left = None if deadline is None else max(0.1, deadline - time.monotonic())
                try:
                    out, err = proc.communicate(timeout=left)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    out, err = proc.communicate()
                results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        finally:
            for proc in procs:
                _kill_group(proc)
        return results

    def _run_ip(self, *args: str) -> None:
        _checked([self._ip, *args], self._tool_env)

    def _run_tc(self, *args: str) -> None:
        _checked([self._tc, *args], self._tool_env)


# -- the machine ----------------------------------------------------------------------------


def _tools(root: str | None) -> tuple[str, str, dict[str, str]]:
    """ip's and tc's paths, and the environment they run with."""
    if not root:
        return shutil.which("ip") or "ip", shutil.which("tc") or "tc", dict(os.environ)
    found = {}
    for tool in ("ip", "tc"):
        for folder in ("usr/sbin", "sbin", "usr/bin", "bin"):
            path = Path(root, folder, tool)
            if path.is_file() and os.access(path, os.X_OK):
                found[tool] = str(path)
                break
        else:
            raise FileNotFoundError(f"no {tool} under iproute_root={root}")
    libs = [f"{root}/usr/lib/x86_64-linux-gnu", f"{root}/lib/x86_64-linux-gnu"]
    caller = os.environ.get("LD_LIBRARY_PATH", "")
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join([*libs, caller] if caller else libs)}
    return found["ip"], found["tc"], env


def visible_gpus() -> tuple[list[str] | None, str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries, and where that came
    from: that variable where set, else ``nvidia-smi -L``'s list, else None (unknown). Without
    torch, so that a lab of GPU hosts is made (and checked) on a machine without CUDA too."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [d.strip() for d in visible.split(",")]
        # CUDA stops at the first entry that is not a device; "-1" (or "") hides them all
        devices = []
        for d in entries:
            if not d or d.startswith("-"):
                break
            devices.append(d)
        return devices, f"CUDA_VISIBLE_DEVICES={visible!r}"
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None, "no nvidia-smi"
    if listed.returncode != 0:
        return None, "nvidia-smi -L failed"
    count = sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(count)], "nvidia-smi -L"


def unavailable(iproute_root: str | None = None) -> str | None:
    """Why a lab cannot run here (not root, no iproute2, namespaces refused), or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    try:
        ip, tc, env = _tools(iproute_root)
    except FileNotFoundError as e:
        return str(e)
    for tool in (ip, tc):
        try:
            subprocess.run([tool, "-V"], env=env, capture_output=True, check=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return f"{tool} does not run: install iproute2 (ip, tc)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = subprocess.run([ip, "netns", "add", probe], env=env, capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run([ip, "netns", "delete", probe], env=env, capture_output=True)
    return None


def remove_stale(iproute_root: str | None = None) -> list[str]:
    """Remove the namespaces of runs whose process is gone (killed before cleaning up);
    those of live runs stay. Returns the names removed."""
    ip, _, env = _tools(iproute_root)
    listed = subprocess.run([ip, "netns", "list"], env=env, capture_output=True, text=True)
    removed = []
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{PREFIX}(?:\d+|sw|probe)-(\d+)", name)
        if match and not _alive(int(match.group(1))):
            _remove(name, ip, env)
            removed.append(name)
    if removed:
        log.warning("cgx2.netlab: removed namespaces left by killed runs: %s", removed)
    return removed


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not re.search(r"^State:\s*Z", state, re.M)


def _remove(name: str, ip: str, env: Mapping[str, str]) -> None:
    pids = subprocess.run([ip, "netns", "pids", name], env=env, capture_output=True, text=True)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run([ip, "netns", "delete", name], env=env, capture_output=True)


def _checked(command: list[str], env: Mapping[str, str]) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cgx2.netlab: {' '.join(command)} failed: {done.stderr.strip()}")


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- the command line -------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cgx2.testing.netlab",
        description="Run a command in each of N hosts (network namespaces behind a bridge, "
        "links shaped with tc); it gets HOST, NHOSTS, HOST_ADDR, MASTER_ADDR, "
        "GLOO_SOCKET_IFNAME, LINK_RATE and LINK_BURST, and with --gpus-per-host also "
        "GPUS_PER_HOST, CUDA_VISIBLE_DEVICES, NCCL_HOSTID, NCCL_SOCKET_IFNAME and "
        "NCCL_IB_DISABLE (docs/hosts.md). Needs root and iproute2.",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=2,
        help="how many hosts (namespaces), 1..200 (default: %(default)s)",
    )
    p.add_argument(
        "--rate",
        default="10gbit",
        help="each link's rate, each way, tc's units (default: %(default)s)",
    )
    p.add_argument(
        "--burst",
        default=Link.burst,
        help="the token bucket's size, as time at the rate (default: %(default)s)",
    )
    p.add_argument("--delay", default=None, help="one-way delay, e.g. 1ms (default: none)")
    p.add_argument("--loss", type=float, default=None, help="packet loss, percent (default: none)")
    p.add_argument(
        "--mtu",
        type=int,
        default=1500,
        help="the hosts' interfaces' MTU, bytes (default: %(default)s)",
    )
    p.add_argument(
        "--gpus-per-host",
        type=int,
        default=None,
        help="GPU hosts: host h gets GPUs h*N .. h*N+N-1, and NCCL sees hosts joined "
        "by the link (default: none, CPU hosts)",
    )
    p.add_argument(
        "--gpus",
        default=None,
        help="the GPUs to split: a count, or CUDA_VISIBLE_DEVICES entries, comma-"
        "separated (default: CUDA_VISIBLE_DEVICES, else nvidia-smi -L's)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds before killing it all")
    p.add_argument(
        "--iproute-root",
        default=os.environ.get("IPROUTE_ROOT"),
        help="where dpkg -x unpacked iproute2, on an image without ip",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command: ... -- CMD")
    gpus: int | list[str] | None = None
    if args.gpus is not None:
        gpus = int(args.gpus) if args.gpus.strip().isdigit() else args.gpus.split(",")
    try:  # bad arguments are refused before any namespace is made
        link = Link(
            rate=args.rate, burst=args.burst, delay=args.delay, loss=args.loss, mtu=args.mtu
        )
        lab = Lab(
            hosts=args.hosts,
            link=link,
            iproute_root=args.iproute_root,
            gpus_per_host=args.gpus_per_host,
            gpus=gpus,
        )
    except (ValueError, TypeError, FileNotFoundError) as e:
        p.error(str(e))
    reason = unavailable(args.iproute_root)
    if reason:
        print(f"netlab: cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    # SIGTERM as Ctrl-C: the lab's cleanup runs either way.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with lab:
        procs = [lab.popen(i, command) for i in range(args.hosts)]
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        status = 0
        try:
            for proc in procs:
                left = None if deadline is None else max(0.1, deadline - time.monotonic())
                try:
                    code = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    print("netlab: timed out: killing every host's command", file=sys.stderr)
                    code = 124
                status = status or code
        finally:
            for proc in procs:
                _kill_group(proc)
    return status


if __name__ == "__main__":
    sys.exit(main())
