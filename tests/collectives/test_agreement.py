"""Ranks that call a collective differently get a clear error on every rank, naming what
differs, instead of wrong values or a hang."""

import os

import pytest
import torch
import torch.distributed as dist
from stand_ins import CudaEvent

import cgx2
from cgx2.collectives.agreement import DisagreementError


def _disagree(kind: str) -> str:
    rank = dist.get_rank()
    numel, bits, dtype, op, bucket_size = 1024, 4, torch.float32, "sum", 512
    if kind == "numel":  # 2 buckets of 512 either way: payloads of equal size
        numel = 1024 if rank == 0 else 1000
    elif kind == "bits":  # the plain allreduce on one rank, the quantized one on the other
        bits = 4 if rank == 0 else 32
    elif kind == "dtype":
        dtype = torch.float32 if rank == 0 else torch.bfloat16
    elif kind == "op":
        op = "sum" if rank == 0 else "avg"
    elif kind == "bucket_size":  # 2 buckets of 512 or 4 of 256
        bucket_size = 512 if rank == 0 else 256
    x = torch.ones(numel, dtype=dtype)
    try:
        cgx2.quantized_allreduce(x, bits, op=op, bucket_size=bucket_size)
    except DisagreementError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("numel", "numel=[rank 0: 1024, rank 1: 1000]"),
        ("bits", "bits=[rank 0: 4, rank 1: 32]"),
        ("dtype", "dtype=[rank 0: float32, rank 1: bfloat16]"),
        ("op", "reduce_op=[rank 0: sum, rank 1: avg]"),
        ("bucket_size", "bucket_size=[rank 0: 512, rank 1: 256]"),
    ],
)
def test_ranks_that_disagree_all_raise_naming_the_difference(dist2, kind, expected):
    messages = dist2.run(_disagree, kind)
    for rank, message in enumerate(messages):
        assert expected in message, message
        assert f"(this rank {rank}:" in message


def test_agreeing_ranks_go_on_after_a_disagreement(dist2):
    """The failed call left nothing half-sent: the next call works."""
    dist2.run(_disagree, "numel")
    results = dist2.run(_agree)
    assert torch.equal(results[0], results[1])


def _different_collectives() -> str:
    x = torch.ones(2048)
    try:
        if dist.get_rank() == 0:
            cgx2.quantized_allreduce(x, 4)
        else:
            cgx2.quantized_reduce_scatter(x, 4)
    except DisagreementError as e:
        return str(e)
    return "no error"


def test_ranks_that_call_different_collectives_all_raise_naming_them(dist2):
    """Through the store each rank sees which collective the others called (their arguments
    differ in number, so an all-gather of them could not even be made)."""
    for rank, message in enumerate(dist2.run(_different_collectives)):
        assert "rank 0: quantized_allreduce, rank 1: quantized_reduce_scatter" in message
        assert f"this rank {rank}:" in message, message
    results = dist2.run(_agree)  # and the group goes on
    assert torch.equal(results[0], results[1])


def _store_keys_left() -> list[bool]:
    from unittest import mock

    from cgx2.collectives import agreement
    from cgx2.comm import group_store

    store, rank = group_store(dist.group.WORLD), dist.get_rank()
    # Without peer sockets, as larger groups: keys.
    with _without_peer_sockets(), mock.patch.object(agreement, "QUEUE_MAX_RANKS", 0):
        for _ in range(5):
            _agree()
    # the next call's number (taken: keep alike)
    n = next(cgx2.comm.group_state(dist.group.WORLD).agreement_calls)
    dist.barrier()
    return [store.check([f"cgx2/agree/{k}/{rank}"]) for k in range(n)]


def test_each_rank_keeps_only_its_last_two_keys_in_the_store(dist2):
    for present in dist2.run(_store_keys_left):
        assert present[-2:] == [True, True] and not any(present[:-2]), present


def _without_peer_sockets():
    from unittest import mock

    from cgx2.comm import peers

    return mock.patch.object(peers, "connected", lambda group: None)


def _queue_left() -> tuple[int, bool]:
    from cgx2.comm import group_store

    store, rank = group_store(dist.group.WORLD), dist.get_rank()
    with _without_peer_sockets():
        for _ in range(3):
            _agree()
        _disagree("numel")
        _agree()
    dist.barrier()
    keyed = any(store.check([f"cgx2/agree/{k}/{rank}"]) for k in range(8))
    return store.queue_len(f"cgx2/agree/to/{rank}"), keyed


def test_without_peer_sockets_small_groups_exchange_through_queues_leaving_nothing(dist4):
    """Four ranks push to each other's queues and pop them empty, a disagreement included; no
    key is set."""
    for left, keyed in dist4.run(_queue_left):
        assert left == 0 and not keyed


def _through_peer_sockets() -> tuple[int, bool, bool]:
    from cgx2.comm import group_store, peers

    store, rank = group_store(dist.group.WORLD), dist.get_rank()
    message = _disagree("numel")
    _agree()
    dist.barrier()
    keyed = any(store.check([f"cgx2/agree/{k}/{rank}"]) for k in range(8))
    queued = store.queue_len(f"cgx2/agree/to/{rank}") if hasattr(store, "queue_len") else 0
    return message, peers.connected(dist.group.WORLD) is not None, keyed or queued > 0


def test_ranks_compare_through_sockets_to_their_peers_not_the_store(dist4):
    for message, connected, stored in dist4.run(_through_peer_sockets):
        assert "numel=[rank 0: 1024, rank 1: 1000, rank 2: 1000, rank 3: 1000]" in message
        assert connected and not stored


def _one_rank_cannot_listen() -> tuple[bool, str]:
    from unittest import mock

    from cgx2.comm import peers

    group = dist.new_group(backend="gloo")  # its peer sockets are made at its first check
    broken = mock.patch.object(peers, "_listen_address", side_effect=OSError("no address"))
    with broken if dist.get_rank() == 1 else mock.MagicMock():
        found = peers.connected(group)
    x = torch.ones(1000 if dist.get_rank() == 0 else 1024)
    try:
        cgx2.quantized_allreduce(x, 4, group=group)
        message = "no error"
    except DisagreementError as e:
        message = str(e)
    return found is None, message


def test_where_a_rank_cannot_make_peer_sockets_every_rank_compares_through_the_store(dist2):
    for without, message in dist2.run(_one_rank_cannot_listen):
        assert without and "numel=[rank 0: 1000, rank 1: 1024]" in message, message


def _socket_pair_ranks():
    """Two :class:`PeerSockets` joined by a socket pair, as ranks 0 and 1 of a group."""
    import socket

    from cgx2.comm.peers import PeerSockets

    a, b = socket.socketpair()
    a.settimeout(30)
    b.settimeout(30)
    return PeerSockets([None, a], 0, 30), PeerSockets([b, None], 1, 30)


def test_peer_sockets_name_ranks_at_different_calls_and_a_peer_that_ended():

    from cgx2.collectives import agreement

    ranks = _socket_pair_ranks()
    _ranks_at_calls_7_and_6_both_raise(
        lambda r, n: agreement._values_by_rank(
            ranks[r].exchange(agreement._with_call_number(n, r, b"x")), n, r
        )
    )
    zero, one = ranks
    one.close()
    with pytest.raises(RuntimeError, match="rank 1"):
        zero.exchange(b"x")


def test_a_silent_peer_fails_the_exchange_after_the_groups_timeout_naming_it():
    import socket
    import time

    from cgx2.comm.peers import PeerSockets

    a, b = socket.socketpair()
    a.settimeout(0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 did not answer within the group's timeout"):
        PeerSockets([None, a], 0, 0.5).exchange(b"x")
    assert 0.5 <= time.monotonic() - start < 5
    b.close()


def test_ranks_at_different_calls_all_raise_naming_them():
    """A rank whose count of checked calls differs (a check skipped by its settings) makes
    every rank raise at once, naming the calls, instead of pairing wrong entries."""
    import datetime

    from cgx2.collectives import agreement

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))

    def exchange(r: int, n: int) -> None:
        store = dist.TCPStore(
            "127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=30)
        )
        agreement._through_queues(store, n, b"x", 2, r, None)

    _ranks_at_calls_7_and_6_both_raise(exchange)


def test_a_peers_next_call_popped_early_waits_for_this_ranks_next_call():
    """After a disagreement no collective holds the fast ranks back: rank 2's entry for call 4
    can reach rank 0's queue before rank 1's for call 3. Rank 0 keeps it for call 4."""
    import datetime
    import struct

    from cgx2.collectives import agreement

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))

    def entry(n: int, rank: int) -> bytes:
        return agreement._with_call_number(n, rank, f"call {n}".encode())

    for n, rank in ((3, 2), (4, 2), (3, 1)):
        store.queue_push("cgx2/agree/to/0", entry(n, rank))
    early = {}
    found = agreement._through_queues(store, 3, b"call 3", 3, 0, None, early)
    assert found == [b"call 3"] * 3 and list(early) == [2]
    store.queue_push("cgx2/agree/to/0", entry(4, 1))
    found = agreement._through_queues(store, 4, b"call 4", 3, 0, None, early)
    assert found == [b"call 4"] * 3 and early == {}
    assert store.queue_len("cgx2/agree/to/0") == 0
    assert struct.unpack_from("<q", store.queue_pop("cgx2/agree/to/1"))[0] == 3  # rank 0's


def _ranks_at_calls_7_and_6_both_raise(exchange) -> None:
    """``exchange(rank, call)`` on two threads, rank 0 at call 7 and rank 1 at call 6: both
    raise, naming the other's call and their own."""
    import threading

    errors = {}

    def rank(r: int, n: int) -> None:
        try:
            exchange(r, n)
        except DisagreementError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r, n)) for r, n in ((0, 7), (1, 6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert "(rank 1 at call 6; this rank 0 at call 7)" in errors[0], errors
    assert "(rank 0 at call 7; this rank 1 at call 6)" in errors[1], errors


def _agree() -> torch.Tensor:
    return cgx2.quantized_allreduce(torch.arange(2048, dtype=torch.float32), 4)


def _backend_minimal_size_differs() -> str:
    rank = dist.get_rank()
    os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"] = "4"
    os.environ["CGX_COMPRESSION_MINIMAL_SIZE"] = "16" if rank == 0 else "100000"
    cgx2.config.refresh()  # cgx2 reads the variables once
    group = dist.new_group(backend="cgx")  # reads the variables
    try:
        dist.all_reduce(torch.ones(4096), group=group)
    except DisagreementError as e:
        return str(e)
    finally:
        del os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"]
        del os.environ["CGX_COMPRESSION_MINIMAL_SIZE"]
        cgx2.config.refresh()
        dist.destroy_process_group(group)
    return "no error"


def test_the_cgx_backend_names_a_minimal_size_that_differs(dist2):
    for message in dist2.run(_backend_minimal_size_differs):
        assert "minimal_size=[rank 0: 16, rank 1: 100000]" in message, message


def test_turned_off_nothing_is_checked(dist2):
    assert dist2.run(_unchecked) == [0, 0]


def _unchecked() -> int:
    from unittest import mock

    from cgx2.collectives import agreement

    with cgx2.config.tuned(check_agreement="off"), mock.patch.object(agreement, "check") as check:
        cgx2.quantized_allreduce(torch.ones(4096), 4)
    return check.call_count


def test_deferred_on_cpu_tensors_is_checked_at_once(dist2):
    """Only an answer that lands on a GPU is worth not waiting for: ranks that disagree on the
    route (bits 4 and 32) raise before their collectives could pass each other."""
    messages = dist2.run(_disagree_deferred)
    assert all("bits=[rank 0: 4, rank 1: 32]" in m for m in messages), messages


def _disagree_deferred() -> str:
    with cgx2.config.tuned(check_agreement="deferred"):
        return _disagree("bits")


def test_a_result_settled_after_a_disagreement_is_nan_everywhere():
    from cgx2.collectives import agreement

    group = _Group()
    out = torch.arange(6, dtype=torch.float32)
    assert agreement.settle(torch.tensor(False), out, group) is out
    assert out.isnan().all()
    agreed = torch.arange(6, dtype=torch.float32)
    agreement.settle(torch.tensor(True), agreed, group)
    assert torch.equal(agreed, torch.arange(6, dtype=torch.float32))


class _Group:
    pass


def test_a_deferred_answer_raises_once_it_arrives_and_never_waits():
    from cgx2.collectives import agreement

    group, event = _Group(), CudaEvent()
    rows = torch.tensor([[1024, 0, 4], [1000, 0, 4]])
    pending = agreement._Pending(
        rows,
        event,
        ["numel", "dtype", "bits"],
        {"numel": 1024, "dtype": torch.float32, "bits": 4},
        "quantized_allreduce",
        0,
    )
    cgx2.comm.group_state(group).agreement_pending.append(pending)
    agreement.raise_pending(group)  # not arrived: nothing raised, nothing waited for
    event.done = True
    with pytest.raises(DisagreementError, match=r"numel=\[rank 0: 1024, rank 1: 1000\]"):
        agreement.raise_pending(group)
    agreement.raise_pending(group)  # raised once, then forgotten


def _two_groups_from_two_threads(path: str) -> dict[int, str]:
    """Each of two threads calls on its own new group (made here, so that its first call sets
    up its peer sockets, shared memory and crossovers), the threads started in opposite order
    on the two ranks ("one thread on rank 0": rank 0 calls on the first group, then on the
    second, from one thread, while rank 1 starts the second's thread first)."""
    import contextlib
    import datetime
    import threading
    import time

    short = datetime.timedelta(seconds=3)
    groups = [dist.new_group(backend="gloo", timeout=short) for _ in range(2)]
    # The store's own blocking waits run out as the groups' do: a thread stuck behind another's
    # wait fails in seconds, not in the pool's timeout.
    store = dist.distributed_c10d._get_default_store()
    saved = store.timeout
    store.set_timeout(short)
    settings = {
        "sockets": contextlib.nullcontext(),
        "store": _without_peer_sockets(),
        "unchecked": cgx2.config.tuned(check_agreement="off"),
        "one thread on rank 0": contextlib.nullcontext(),
    }[path]
    results = {}

    def calls(i: int) -> None:
        try:
            for _ in range(3):
                cgx2.quantized_allreduce(torch.ones(4096), 4, group=groups[i])
            results[i] = "ok"
        except Exception as e:  # reported to the test
            results[i] = repr(e)

    threads = [threading.Thread(target=calls, args=(i,), daemon=True) for i in range(2)]
    if path == "one thread on rank 0" and dist.get_rank() == 0:
        threads = [threading.Thread(target=lambda: (calls(0), calls(1)), daemon=True)]
    try:
        with settings:
            for t in threads if dist.get_rank() == 0 else threads[::-1]:
                t.start()
                time.sleep(0.2)  # the first thread is waiting on its peer when the second starts
            for t in threads:
                t.join(30)
    finally:
        store.set_timeout(saved)
    return {i: results.get(i, "still running") for i in range(2)}


@pytest.mark.parametrize("path", ["sockets", "store", "unchecked", "one thread on rank 0"])
def test_two_threads_calling_on_two_groups_in_opposite_orders_do_not_deadlock(dist2, path):
    """A thread waiting on one group's peers (set-up, or a check through the store) must not
    hold up another thread's calls on another group: the peers of that one may be waiting for
    them. Before, both threads' waits went through the process's one store client in turn."""
    for rank, results in enumerate(dist2.run(_two_groups_from_two_threads, path)):
        assert results == {0: "ok", 1: "ok"}, (rank, results)


# Two values of each setting that changes the bytes, and how the message shows them.
_SETTINGS = {
    "CGX2_PIPELINE_BYTES": (("64K", "65536"), ("128K", "131072")),
    "CGX2_PAIR_GATHER": (("1", "True"), ("0", "False")),
    "CGX2_NODE_MESH": (("0", "False"), ("1", "True")),
    "CGX2_TRANSPORT": (("shm", "shm"), ("process_group", "process_group")),
    "CGX2_ALGORITHM": (("sra", "sra"), ("ring", "ring")),
    "CGX2_CROSSOVER_BYTES": (("0", "0"), ("1K", "1024")),
    "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS": (("0", "False"), ("1", "True")),
    "CGX_COMPRESSION_MINIMAL_SIZE": (("16", "16"), ("64", "64")),
    "CGX_FUSION_BUFFER_SIZE_MB": (("64", "64"), ("32", "32")),
    "CGX_INNER_COMMUNICATOR_TYPE": (("SHM", "SHM"), ("MPI", "MPI")),
    "CGX_INTRA_BROADCAST": (("0", "False"), ("1", "True")),
}


def test_every_setting_is_compared_or_said_why_not():
    """Each field of the settings is in exactly one list: compared with the route, compared at
    every call, or not compared with a reason; and each compared variable is tried below."""
    import dataclasses

    from cgx2 import config

    fields = [
        f.name for cls in (config.TuningConfig, config.CGXConfig) for f in dataclasses.fields(cls)
    ]
    lists = (config.WIRE_SETTINGS, config.COMPARED_PER_CALL, config.NOT_COMPARED)
    for name in fields:
        assert sum(name in found for found in lists) == 1, name
    assert set().union(*lists) == set(fields)
    assert set(_SETTINGS) == {*config.WIRE_SETTINGS.values(), "CGX2_CROSSOVER_BYTES"}


def _setting_differs(variable: str) -> str:
    from env_vars import setenv

    rank = dist.get_rank()
    try:
        with setenv(**{variable: _SETTINGS[variable][rank][0]}):
            cgx2.config.reload()
            cgx2.quantized_allreduce(torch.ones(4096), 4)
    except DisagreementError as e:
        return str(e)
    finally:
        cgx2.config.reload()
    return "no error"


@pytest.mark.parametrize("variable", sorted(_SETTINGS))
def test_ranks_whose_settings_differ_all_raise_naming_the_variable(dist2, variable):
    """Before, ranks that differed only in a routing variable aborted in gloo ("Received data
    size doesn't match") or waited out the timeout; now every rank names it."""
    (_, first), (_, second) = _SETTINGS[variable]
    for rank, message in enumerate(dist2.run(_setting_differs, variable)):
        assert f"{variable}=[rank 0: {first}, rank 1: {second}]" in message, message
        assert f"(this rank {rank}: {variable}={(first, second)[rank]}" in message, message
    results = dist2.run(_agree)  # and the group goes on
    assert torch.equal(results[0], results[1])


def test_a_deferred_answer_of_different_settings_shows_this_ranks():
    """On the GPU the answer comes too late for a second exchange: each rank names the settings
    as what differs and shows its own, variable by variable."""
    from cgx2.collectives import agreement

    group, event = _Group(), CudaEvent()
    event.done = True
    rows = torch.tensor([[1024, 0, 11], [1024, 0, 22]])
    mine = '{"CGX2_PAIR_GATHER":true}'
    pending = agreement._Pending(
        rows,
        event,
        ["numel", "dtype", "settings"],
        {"numel": 1024, "dtype": torch.float32, "settings": mine},
        "quantized_allreduce",
        0,
    )
    cgx2.comm.group_state(group).agreement_pending.append(pending)
    with pytest.raises(DisagreementError, match="settings their routes were decided under") as e:
        agreement.raise_pending(group)
    assert f"this rank 0: settings={mine}" in str(e.value)
