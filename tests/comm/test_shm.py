"""The shared-memory transport: the reference's bytes through it, private segments that never
have a name, several groups at once, hostile files, calls that fail on some ranks or all, and
the process group where the extension is absent or a group spans hosts."""

import glob
import logging
import os
import stat
import tempfile
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import cgx2
from cgx2 import collectives, cpu_threads, extension
from cgx2.codecs import maxmin_codec
from cgx2.collectives import CallSettings, policy, reference_allreduce
from cgx2.comm import process_group, shm
from cgx2.config import tuned

pytestmark = pytest.mark.skipif(not shm.available(), reason="cgx2._C was not built here")

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def _cgx2_files() -> list[str]:
    return glob.glob(f"/dev/shm/cgx2-{os.geteuid()}-*")


def _reference_bytes(cases) -> list[tuple[bool, bool, bool]]:
    """Each case through shared memory: the reference's bytes, bit-identical on every rank
    (compared by the caller), and the process group's bytes too."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    found = []
    for bits, dtype, n, op in cases:
        x = _input(rank, n, dtype)
        inputs = [_input(r, n, dtype) for r in range(world)]
        with tuned(transport="shm", crossover_bytes=0):
            assert policy.route(x, group, bits, 512).transport is shm
            got = collectives.allreduce(x, group, CallSettings(bits, 512, op, 7))
        with tuned(transport="process_group", crossover_bytes=0):
            assert policy.route(x, group, bits, 512).transport is process_group
            over_gloo = collectives.allreduce(x, group, CallSettings(bits, 512, op, 7))
        want = reference_allreduce(inputs, bits, 512, seed=7, reduce_op=op)
        found.append(
            (
                torch.equal(got.view(torch.uint8), want.view(torch.uint8)),
                torch.equal(got.view(torch.uint8), over_gloo.view(torch.uint8)),
                shm.serves(group),
            )
        )
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_scatter_reduce_allgather_is_the_references_bytes(dist2, dist4, world):
    pool = dist2 if world == 2 else dist4
    cases = [
        (bits, dtype, n, op)
        for bits, dtype in (
            (4, torch.float32),
            (2, torch.bfloat16),
            (8, torch.float16),
            (3, torch.float64),
        )
        for n in (1, 513, 70_001)
        for op in ("sum", "avg")
    ]
    results = pool.run(_reference_bytes, cases)
    for rank_results in results:
        assert all(all(r) for r in rank_results), rank_results


def _plain_sums(n: int) -> list[bool]:
    """The uncompressed allreduce through shared memory: the sum in rank order (dtype by
    dtype), pieces of a long tensor included."""
    world = dist.get_world_size()
    found = []
    for dtype in DTYPES:
        x = _input(dist.get_rank(), n, dtype)
        gathered = [_input(r, n, dtype) for r in range(world)]
        want = gathered[0] + gathered[1]
        for other in gathered[2:]:
            want += other
        with mock.patch.object(shm, "PLAIN_PIECE_BYTES", 4096):  # several pieces
            got = shm.allreduce_plain_(x.clone(), dist.group.WORLD, "sum")
        found.append(torch.equal(got, want))
    ints = torch.arange(10, dtype=torch.int64) * (dist.get_rank() + 1)
    found.append(
        torch.equal(
            shm.allreduce_plain_(ints, dist.group.WORLD, "sum"),
            torch.arange(10) * sum(range(1, world + 1)),
        )
    )
    return found


def test_the_plain_allreduce_sums_in_rank_order(dist2, dist4):
    for pool in (dist2, dist4):
        assert all(all(r) for r in pool.run(_plain_sums, 10_007))


def _segments_are_private_and_nameless() -> tuple[list[str], list[int]]:
    group = dist.new_group(list(range(dist.get_world_size())))
    x = torch.randn(100_000)
    with tuned(transport="shm"):
        shm.allreduce_plain_(x, group, "sum")
    left = _cgx2_files()
    modes = []
    with open("/proc/self/maps") as f:
        for line in f:
            assert "/dev/shm/cgx2" not in line, line
            if "/memfd:cgx2-segment" in line:
                span = line.split()[0]
                modes.append(stat.S_IMODE(os.stat(f"/proc/self/map_files/{span}").st_mode))
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the listing's own
            continue
    dist.destroy_process_group(group)
    return left, modes, [fd for fd in fds if "cgx2" in fd]


def test_segments_are_0600_and_have_no_name(dist2):
    if os.geteuid() != 0:
        pytest.skip("/proc/self/map_files needs root")
    for left, modes, fds in dist2.run(_segments_are_private_and_nameless):
        assert left == []  # nothing in /dev/shm while the job runs
        # each rank maps its own and its peer's, and keeps no descriptor once both have
        assert len(modes) >= 2 and all(m == 0o600 for m in modes), modes
        assert fds == [], fds


def test_a_segment_is_created_0600_whatever_the_umask_and_opened_by_descriptor():
    lib = extension.load()
    old = os.umask(0)
    try:
        segment = lib.Segment.create(8192)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(f"/proc/self/fd/{segment.fd}").st_mode) == 0o600
    torch.frombuffer(segment.memoryview(), dtype=torch.uint8).fill_(7)
    again = lib.Segment.open(os.getpid(), segment.fd, 8192, segment.inode)
    assert torch.frombuffer(again.memoryview(), dtype=torch.uint8).eq(7).all()
    with pytest.raises(PermissionError, match="not the file its creator announced"):
        lib.Segment.open(os.getpid(), segment.fd, 8192, segment.inode + 1)
    with pytest.raises(PermissionError, match="smaller than its creator announced"):
        lib.Segment.open(os.getpid(), segment.fd, 16384, segment.inode)
    segment.release()
    assert segment.fd == -1
    with pytest.raises(OSError):
        lib.Segment.open(os.getpid(), 1 << 20, 8192, segment.inode)  # no such descriptor


@pytest.mark.parametrize(
    "mode, message", [(0o644, "open to other users"), (0o660, "open to other users")]
)
def test_a_segment_others_could_write_is_refused(mode, message):
    lib = extension.load()
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()
        os.fchmod(fd, mode)
        os.ftruncate(fd, 8192)
        inode = os.fstat(fd).st_ino
        with pytest.raises(PermissionError, match=message):
            lib.Segment.open(os.getpid(), fd, 8192, inode)
        if os.geteuid() == 0:
            os.fchmod(fd, 0o600)
            os.fchown(fd, 12345, 12345)
            with pytest.raises(PermissionError, match="owned by another user"):
                lib.Segment.open(os.getpid(), fd, 8192, inode)


def _two_groups() -> list[bool]:
    """Two groups of the same ranks, their calls interleaved, and a pipeline's calls in flight
    on each: every result is the process group's."""
    world = dist.get_world_size()
    other = dist.new_group(list(range(world)))
    found = []
    for i in range(6):
        x = _input(dist.get_rank() + i, 50_000, torch.float32)
        results = {}
        for transport in ("shm", "process_group"):
            with tuned(transport=transport, crossover_bytes=0, pipeline_bytes=4 * 512 * world):
                a = collectives.allreduce(x, dist.group.WORLD, CallSettings(4, 512, seed=i))
                b = collectives.allreduce(x * 2, other, CallSettings(4, 512, seed=i))
                c = shm.allreduce_plain_(x.clone(), other, "avg") if transport == "shm" else None
            results[transport] = (a, b, c)
        found.append(torch.equal(results["shm"][0], results["process_group"][0]))
        found.append(torch.equal(results["shm"][1], results["process_group"][1]))
        exact = x.clone()
        dist.all_reduce(exact)
        found.append(torch.allclose(results["shm"][2], exact / world, rtol=1e-6, atol=1e-6))
    found.append(shm.serves(other) and shm.serves(dist.group.WORLD))
    dist.destroy_process_group(other)
    return found


def test_two_groups_at_once(dist2, dist4):
    for pool in (dist2, dist4):
        assert all(all(r) for r in pool.run(_two_groups))


def _without_the_extension() -> tuple[bool, bool, str]:
    """``cgx2._C`` missing: routes take the process group, results are unchanged, the
    warning says so once."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("cgx2").addHandler(handler)
    real_import = __import__("importlib").import_module

    def no_extension(name, *args):
        if name == "cgx2._C":
            raise ImportError("No module named 'cgx2._C'")
        return real_import(name, *args)

    x = _input(dist.get_rank(), 10_000, torch.float32)
    with tuned(crossover_bytes=0):
        with_it = cgx2.quantized_allreduce(x, 4, seed=3)
    try:
        extension.load.cache_clear()
        with mock.patch("importlib.import_module", no_extension), tuned(crossover_bytes=0):
            route = policy.route(x, dist.group.WORLD, 4, 512)
            without = cgx2.quantized_allreduce(x, 4, seed=3)
            cgx2.quantized_allreduce(x, 4, seed=4)
    finally:
        logging.getLogger("cgx2").removeHandler(handler)
        extension.load.cache_clear()
        policy.reset()
    warnings = [r.getMessage() for r in records if "cgx2._C is missing" in r.getMessage()]
    return route.transport is process_group, torch.equal(with_it, without), warnings


def test_without_the_extension_the_process_group_carries_it(dist2):
    for uses_process_group, same, warnings in dist2.run(_without_the_extension):
        assert uses_process_group and same
        assert len(warnings) == 1 and "shared-memory transport is off" in warnings[0]


def _a_segment_a_rank_cannot_open() -> tuple[bool, list[str]]:
    """Rank 1 cannot open its peer's segment: every rank agrees to use the process group; the
    call still returns the right sum."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("cgx2").addHandler(handler)
    group = dist.new_group(list(range(dist.get_world_size())))
    lib = extension.load()

    class Refusing:
        create = lib.Segment.create

        @staticmethod
        def open(*args):
            raise PermissionError(13, "Permission denied")

    try:
        with mock.patch.object(lib, "Segment", Refusing if dist.get_rank() == 1 else lib.Segment):
            x = torch.full((1000,), float(dist.get_rank() + 1))
            got = shm.allreduce_plain_(x, group, "sum")
    finally:
        logging.getLogger("cgx2").removeHandler(handler)
    served = shm.serves(group)
    dist.destroy_process_group(group)
    return (
        torch.equal(got, torch.full((1000,), 3.0)) and not served,
        [r.getMessage() for r in records if "unavailable" in r.getMessage()],
    )


def test_a_segment_that_cannot_be_opened_leaves_the_process_group(dist2):
    for ok, warnings in dist2.run(_a_segment_a_rank_cannot_open):
        assert ok
        assert len(warnings) == 1 and "Permission denied" in warnings[0], warnings


def _short_group() -> dist.ProcessGroup:
    """A group of every rank that waits 5 s, not the pool's 120: a hang fails quickly."""
    return dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=5))


def _quantized_calls(group: dist.ProcessGroup, seeds: range) -> list[bool]:
    """Quantized allreduces over shared memory, each the process group's bytes."""
    found = []
    for seed in seeds:
        x = _input(dist.get_rank() + seed, 20_001, torch.float32)
        got = {}
        for transport in ("shm", "process_group"):
            # In pieces: a piece's exchange is on the wire while the one before it is summed.
            with tuned(
                transport=transport,
                crossover_bytes=0,
                pipeline_bytes=8 * 512 * dist.get_world_size(),
            ):
                got[transport] = collectives.allreduce(x, group, CallSettings(4, 512, seed=seed))
        found.append(torch.equal(got["shm"], got["process_group"]))
    return found


def _after_a_failure_on_every_rank() -> tuple[str, str, list[bool], list[bool]]:
    """A quantized allreduce that fails on every rank after its all-to-all began (its Work is
    never waited for), and a plain one that fails on every rank inside the transport; then
    more calls than the transport has slots, each right."""
    group = _short_group()
    failures = []
    codec = maxmin_codec(torch.device("cpu"))

    def refused(*args, **kwargs):
        raise ValueError("refused after the transport began")

    with mock.patch.object(codec, "decode_sum_encode", refused):
        try:
            _quantized_calls(group, range(1))
        except ValueError as e:
            failures.append(str(e))
    quantized = _quantized_calls(group, range(1, 2 * shm.SLOTS))
    with mock.patch.object(cpu_threads, "add_", refused):
        try:
            shm.allreduce_plain_(torch.ones(1000), group, "sum")
        except (ValueError, shm.ShmError) as e:  # its own failure, or its peer's seen first
            failures.append(str(e))
    world = dist.get_world_size()
    plain = []
    for i in range(2 * shm.SLOTS):
        got = shm.allreduce_plain_(torch.full((1000,), float(i)), group, "sum")
        plain.append(torch.equal(got, torch.full((1000,), float(i * world))))
    dist.destroy_process_group(group)
    return *failures, quantized, plain


def test_a_call_that_fails_on_every_rank_leaves_the_group_working(dist2):
    for quantized_failure, plain_failure, quantized, plain in dist2.run(
        _after_a_failure_on_every_rank
    ):
        assert "refused after the transport began" in quantized_failure
        assert plain_failure == "refused after the transport began" or (
            "of group" in plain_failure and "failed during allreduce" in plain_failure
        ), plain_failure
        assert all(quantized) and all(plain), (quantized, plain)


def _after_a_failure_on_rank_1() -> tuple[str, list[bool]]:
    """Rank 1 fails while it writes an all-gather's payload: rank 0 raises at once, naming
    it, rather than wait or read what is not there; the group's next calls are right."""
    group, rank = _short_group(), dist.get_rank()
    out = torch.empty(2, 1000)

    def refused(region, source):
        raise ValueError("refused while writing")

    outcome = "no error"
    with mock.patch.object(shm, "_stage_in", refused if rank == 1 else shm._stage_in):
        try:
            shm.all_gather(out, torch.full((1000,), rank + 1.0), group, async_op=False)
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
    found = []
    for i in range(2 * shm.SLOTS):
        shm.all_gather(out, torch.full((1000,), rank + i + 1.0), group, async_op=False)
        found.append(
            torch.equal(out, torch.stack([torch.full((1000,), r + i + 1.0) for r in range(2)]))
        )
    dist.destroy_process_group(group)
    return outcome, found


def test_a_call_that_fails_on_one_rank_fails_on_its_peers_at_once(dist2):
    (outcome0, found0), (outcome1, found1) = dist2.run(_after_a_failure_on_rank_1)
    assert outcome1 == "ValueError: refused while writing"
    assert outcome0.startswith("ShmError: cgx2: the shared-memory transport: rank 1 of group")
    assert "failed during all_gather" in outcome0 and "this is rank 0" in outcome0, outcome0
    assert all(found0) and all(found1), (found0, found1)


def _calls_that_no_longer_match() -> tuple[str, str]:
    """Rank 1 drops an all-to-all's Work (as a caller that failed there would) and goes on to
    its next call, another all-to-all, while rank 0 goes on to the all-gather that would
    have followed: both raise, naming the mismatch, and the group is closed at once."""
    group, rank = _short_group(), dist.get_rank()
    send, out = torch.full((2, 500), float(rank)), torch.empty(2, 500)
    outcomes = []
    for _ in range(2):
        try:
            if rank == 0:
                shm.all_to_all(out, send, group, async_op=False)
                shm.all_gather(out.view(-1), send[0], group, async_op=False)
            else:
                shm.all_to_all(out, send, group, async_op=True)  # dropped
                shm.all_to_all(out, send, group, async_op=False)
            outcomes.append("no error")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    dist.destroy_process_group(group)
    return outcomes


def test_ranks_whose_calls_no_longer_match_raise_and_close_the_group(dist2):
    for rank, (first, then) in enumerate(dist2.run(_calls_that_no_longer_match)):
        assert first.startswith("ShmError:") and "no longer match" in first, first
        assert f"this is rank {rank}" in first, first
        assert then.startswith("ShmError:") and "failed earlier" in then, then


def test_the_transport_is_a_transport():
    from cgx2.comm import Transport

    assert isinstance(shm, Transport)
