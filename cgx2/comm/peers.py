"""A TCP connection between every two ranks of a host-side group, for the few bytes each rank
must hear from every peer before a collective (the agreement check): one message a peer.

The group's store would take a round trip a peer to its server, and the group's own
collectives (gloo's) cost more for a few bytes (BENCHMARKS.md, "The agreement check"). The
sockets are made at a group's first use by all its ranks at once, on the address gloo uses
(``GLOO_SOCKET_IFNAME``'s, else the host name's); where any rank cannot make them, every rank
is told so and its caller keeps the store.
"""

from __future__ import annotations

import errno
import logging
import secrets
import socket
import struct
import threading
import time

import torch.distributed as dist

from .. import config
from . import store as stored
from .groups import group_state
from .process_group import group_info, group_store

__all__ = ["PeerSockets", "connected"]

logger = logging.getLogger("cgx2")

SETUP_TIMEOUT_S = 30.0
"""How long a rank waits to connect to, or to be reached by, a peer when the sockets are made
(the group's timeout where shorter); past it every rank keeps the store."""

POLL_S = 0.05
"""How often a rank waiting for its peers to connect looks whether one has given up."""

_HEADER = struct.Struct("<I")
_HELLO = struct.Struct("<16sq")  # the listener's secret, the connecting rank


class PeerSockets:
    """One connected socket a peer of a group (``None`` at this rank's own index)."""

    def __init__(self, sockets: list[socket.socket | None], rank: int, timeout_s: float) -> None:
        self.sockets, self.rank, self.timeout_s = sockets, rank, timeout_s
        self.lock = threading.Lock()

    def exchange(self, message: bytes) -> list[bytes]:
        """Send ``message`` to every peer and return every rank's message of this exchange,
        by rank (this rank's own at its index). A peer that does not answer within the
        group's timeout, or whose process ended, raises ``RuntimeError`` naming it."""
        framed = _HEADER.pack(len(message)) + message
        found: list[bytes] = [b""] * len(self.sockets)
        found[self.rank] = message
        peer = -1
        try:
            with self.lock:
                for peer, sock in enumerate(self.sockets):  # noqa: B007 - the error names it
                    if sock is not None:
                        sock.sendall(framed)
                for peer, sock in enumerate(self.sockets):
                    if sock is not None:
                        (size,) = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
                        found[peer] = _read_exactly(sock, size)
        except TimeoutError as e:
            raise RuntimeError(
                f"cgx2: rank {peer} did not answer within the group's timeout "
                f"({self.timeout_s:.0f} s)"
            ) from e
        except OSError as e:  # reset, or closed: its process ended
            raise RuntimeError(f"cgx2: the connection to rank {peer} failed: {e}") from e
        return found

    def close(self) -> None:
        for sock in self.sockets:
            if sock is not None:
                sock.close()


def connected(group: dist.ProcessGroup) -> PeerSockets | None:
    """``group``'s peer sockets, made at its first call here, where every rank calls it at the
    same point (a collective of the group's store); None on every rank alike where some rank
    could not make them, or the group has no store. A lock a group: making one group's waits
    on its peers, which another thread's calls on another group must not wait for. They go
    with the group (:mod:`.group_state`; a forked child forgets its parent's)."""
    peers = group_state(group).peers
    return peers.value if peers.made else peers.get(lambda: _connect(group))


def _connect(group: dist.ProcessGroup) -> PeerSockets | None:
    store = group_store(group)
    if store is None:
        return None
    info = group_info(group)
    world, rank, timeout = info.size, info.rank, info.timeout_s
    patience = min(SETUP_TIMEOUT_S, timeout)
    secret = secrets.token_bytes(16)
    sockets: list[socket.socket | None] = [None] * world
    listener = None
    try:
        try:
            listener = socket.create_server((_listen_address(), 0), backlog=world)
        finally:  # a rank without a listener says so, so that its peers need not wait for it
            host, port = listener.getsockname()[:2] if listener is not None else ("-", "")
            store.set(f"cgx2/peers/{rank}", f"{host}|{port}|{secret.hex()}")
        problem = _reach(store, listener, sockets, secret, rank, world, patience)
    except (OSError, ValueError, ImportError) as e:  # no address, refused, timed out, a stranger
        problem = f"{type(e).__name__}: {e}"
    finally:
        if listener is not None:
            listener.close()
    store.set(f"cgx2/peers/ready/{rank}", problem or "ok")
    ready = [f"cgx2/peers/ready/{r}" for r in range(world)]
    stored.wait(store, ready, timeout)  # asking, not blocking the store's client
    answers = [store.get(key).decode() for key in ready]
    failed = {r: a for r, a in enumerate(answers) if a != "ok"}
    if failed:
        for sock in sockets:
            if sock is not None:
                sock.close()
        if rank == 0:
            reasons = "; ".join(f"rank {r}: {a}" for r, a in failed.items())
            logger.info(
                "cgx2: no peer sockets on this group (%s); its ranks compare through its store",
                reasons,
            )
        return None
    for sock in sockets:
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(timeout)
    return PeerSockets(sockets, rank, timeout)


def _reach(
    store: dist.Store,
    listener: socket.socket,
    sockets: list[socket.socket | None],
    secret: bytes,
    rank: int,
    world: int,
    patience: float,
) -> str:
    """Connect to the lower ranks and accept the higher ones into ``sockets``; what went
    wrong, or ""."""
    for peer in range(rank):
        try:
            address = stored.get(store, f"cgx2/peers/{peer}", patience).decode()
        except stored.StoreTimeout:
            return f"rank {peer} did not say where it listens within {patience:.0f} s"
        host, port, their_secret = address.split("|")
        if host == "-":
            return f"rank {peer} has no listener"
        sock = socket.create_connection((host, int(port)), timeout=patience)
        sock.sendall(_HELLO.pack(bytes.fromhex(their_secret), rank))
        sockets[peer] = sock
    deadline = time.monotonic() + patience
    listener.settimeout(POLL_S)
    while any(sockets[p] is None for p in range(rank + 1, world)):
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            # A higher rank that has given its answer without connecting never will.
            waiting = [p for p in range(rank + 1, world) if sockets[p] is None]
            if store.check([f"cgx2/peers/ready/{p}" for p in waiting[:1]]):
                return f"rank {waiting[0]} could not connect"
            if time.monotonic() > deadline:
                return f"rank {waiting[0]} did not connect within {patience:.0f} s"
            continue
        sock.settimeout(patience)
        their_secret, peer = _HELLO.unpack(_read_exactly(sock, _HELLO.size))
        if their_secret != secret or not rank < peer < world or sockets[peer] is not None:
            sock.close()
            return "a connection that is not a peer's"
        sockets[peer] = sock
    return ""


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection (its process ended?)")
        data += chunk
    return data


def _listen_address() -> str:
    """The IPv4 address gloo's devices bind to: ``GLOO_SOCKET_IFNAME``'s first interface's,
    else what the host name resolves to."""
    names = config.launch().gloo_socket_ifname
    if names:
        return _interface_address(names.split(",")[0])
    return socket.gethostbyname(socket.gethostname())


def _interface_address(name: str) -> str:
    import fcntl  # Unix's only: elsewhere the ImportError leaves the group on its store

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError as e:  # SIOCGIFADDR: no such interface, or no IPv4 address on it
            raise OSError(errno.ENODEV, f"GLOO_SOCKET_IFNAME={name}: no IPv4 address") from e
    return socket.inet_ntoa(packed[20:24])
