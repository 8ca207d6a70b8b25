"""CUDA-graph replay (cgx2.collectives.graphs): the keys derived on the device match
cgx2.seeding, and the cache runs, captures, replays and evicts in the right order. The
capture itself needs a GPU (bench/gpu_allreduce_check.py checks its bytes); here a stand-in
records what it was given."""

import logging

import pytest
import torch

from cgx2 import config
from cgx2.collectives import decision, graphs, policy
from cgx2.seeding import derive_key

keys_triton = pytest.importorskip("cgx2.codecs.keys_triton", reason="Triton is not installed")
# Where the key kernel runs: compiled on a GPU, else under the interpreter (tests/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF])
@pytest.mark.parametrize(("rank", "pieces"), [(0, 1), (3, 70)])
def test_piece_keys_match_seeding(seed, rank, pieces):
    device_seed = torch.tensor([_signed(seed)], device=DEVICE)
    got = [v % (1 << 64) for v in keys_triton.piece_keys(device_seed, rank, pieces, 1, 2).tolist()]
    expected = []
    for i in range(pieces):
        expected += [derive_key(seed, 1, rank, i), derive_key(seed, 2, i)]
    assert got == expected


class _Group:
    """Stands in for a process group (graphs only key on it and watch it go)."""


GROUP = _Group()
G = id(GROUP)
CPU = torch.device("cpu")


class _FakeGraph:
    """Stands in for a captured graph: replaying runs the pipeline again, reading the seed."""

    def __init__(self, pipeline, device_seed):
        self.pipeline, self.device_seed = pipeline, device_seed

    def replay(self):
        self.pipeline(self.device_seed)


@pytest.fixture
def fake_capture(monkeypatch):
    captured = []

    def capture(pipeline, device_seed):
        captured.append(device_seed)
        return _FakeGraph(pipeline, device_seed)

    monkeypatch.setattr(graphs, "_capture", capture)
    monkeypatch.setattr(graphs._CACHE, "failed", False)
    graphs._CACHE.pending.clear()
    graphs._CACHE.graphs.clear()
    yield captured
    graphs._CACHE.pending.clear()
    graphs._CACHE.graphs.clear()


def test_first_call_eager_second_captures_then_replays(fake_capture):
    seen = []

    def pipeline(device_seed):
        seen.append(int(device_seed.item()))

    seeds = [5, 2**64 - 3, 7, 2**63]
    for seed in seeds:
        graphs.run(GROUP, (1,), seed, CPU, pipeline)
    assert len(fake_capture) == 1  # captured once, at the second call
    assert seen == [_signed(s) for s in seeds]  # every call read its own seed
    assert list(graphs._CACHE.graphs) == [(G, 1)] and not graphs._CACHE.pending


def test_a_cycle_longer_than_the_cache_captures_once_and_never_syncs(fake_capture, monkeypatch):
    """DDP's buckets of a large model: more signatures, over and over, than graphs kept. The
    first MAX_GRAPHS seen twice replay; the others run eagerly, none is captured again."""
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synced"))
    monkeypatch.setattr(graphs._CACHE, "counts", dict.fromkeys(graphs._CACHE.counts, 0))
    eager = []
    for _ in range(5):
        for signature in (1, 2, 3):
            graphs.run(GROUP, (signature,), 0, CPU, lambda s: eager.append(1))
    assert list(graphs._CACHE.graphs) == [(G, 1), (G, 2)]
    assert len(fake_capture) == 2
    assert list(graphs._CACHE.pending) == [(G, 3)]
    # Signatures 1 and 2: eager once, then captured and replayed 4 times; 3: eager 5 times.
    assert graphs.stats() == {"eager": 2 + 5, "captures": 2, "replays": 8, "graphs": 2}


def test_a_stale_graph_makes_room_after_a_sync(fake_capture, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 2)
    monkeypatch.setattr(graphs, "STALE_CALLS", 3)
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    for signature in (1, 1, 2, 2, 2, 2, 2, 3, 3):  # graph 1 last replayed 6 calls before
        graphs.run(GROUP, (signature,), 0, CPU, lambda s: None)
    assert list(graphs._CACHE.graphs) == [(G, 2), (G, 3)]
    assert len(syncs) == 1


def test_calls_seen_once_never_push_out_a_graph(fake_capture, monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS", 1)
    monkeypatch.setattr(graphs, "MAX_PENDING", 3)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: pytest.fail("synced"))
    calls = []
    for signature in (0, 0, 1, 2, 3, 4, 0):
        graphs.run(GROUP, (signature,), signature, CPU, calls.append)
    assert list(graphs._CACHE.graphs) == [(G, 0)]
    assert list(graphs._CACHE.pending) == [(G, 2), (G, 3), (G, 4)]
    assert len(fake_capture) == 1


def test_failed_capture_runs_eagerly_and_stops_capturing(fake_capture, monkeypatch, caplog):
    def broken(pipeline, device_seed):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", broken)
    seen = []
    with caplog.at_level(logging.WARNING, logger="cgx2"):
        for seed in (1, 2):
            graphs.run(GROUP, (1,), seed, CPU, lambda s: seen.append(int(s.item())))
    assert seen == [1, 2]
    assert graphs._CACHE.failed
    assert "launching eagerly" in caplog.text


@pytest.mark.parametrize(
    ("raw", "expected"), [("", None), ("auto", None), ("0", False), ("1", True), ("on", True)]
)
def test_environment_variable(raw, expected):
    assert config.TuningConfig.from_env({"CGX2_CUDA_GRAPHS": raw}).cuda_graphs is expected


def test_environment_variable_rejects_junk():
    with pytest.raises(ValueError, match="CGX2_CUDA_GRAPHS"):
        config.TuningConfig.from_env({"CGX2_CUDA_GRAPHS": "maybe"})


@pytest.mark.parametrize(
    ("setting", "nbytes", "expected"),
    [
        (None, policy.GRAPHS_AUTO_MAX_BYTES, True),
        (None, policy.GRAPHS_AUTO_MAX_BYTES + 1, False),
        (True, 1 << 34, True),
        (False, 1024, False),
    ],
)
def test_which_compressed_calls_replay_graphs(setting, nbytes, expected):
    """auto (the default): calls up to the policy's bound; 1: all; 0: none."""
    with config.tuned(cuda_graphs=setting):
        assert decision.graphed(nbytes, config.tuning().cuda_graphs) is expected


def test_turned_off_graphs_are_unusable_and_cpu_tensors_never_usable():
    with config.tuned(cuda_graphs=False):
        assert not graphs.usable(torch.empty(4, device=DEVICE))
    with config.tuned(cuda_graphs=True):
        assert not graphs.usable(torch.empty(4))


def test_destroying_a_group_drops_its_graphs_first(fake_capture, monkeypatch):
    """A graph holding a communicator's collectives kept NCCL from destroying it: once a graph
    is captured, destroy_process_group drops the group's graphs (all, for the default group)
    before the communicator goes."""
    import atexit

    import torch.distributed as dist

    left_at_destroy = []

    def original(group=None):
        left_at_destroy.append((group, list(graphs._CACHE.graphs)))

    monkeypatch.setattr(dist, "destroy_process_group", original)
    monkeypatch.setattr(dist.distributed_c10d, "destroy_process_group", original)
    monkeypatch.setattr(graphs._CACHE, "guarded", False)
    monkeypatch.setattr(atexit, "register", lambda fn: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    sub = _Group()
    for group in (GROUP, GROUP, sub, sub):  # one graph each
        graphs.run(group, (1,), 0, CPU, lambda s: None)
    assert dist.destroy_process_group is not original  # wrapped at the first capture
    dist.destroy_process_group(sub)
    dist.destroy_process_group()
    assert left_at_destroy == [(sub, [(G, 1)]), (None, [])]


def test_a_collected_group_takes_its_graphs(fake_capture, monkeypatch):
    """Graphs are keyed by the group's id: when the group goes, so do they, before another
    group can get its id."""
    import gc

    monkeypatch.setattr(graphs, "_guard_teardown", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    gone = _Group()
    for group in (GROUP, GROUP, gone, gone):
        graphs.run(group, (1,), 0, CPU, lambda s: None)
    assert len(graphs._CACHE.graphs) == 2
    del group, gone
    gc.collect()
    assert list(graphs._CACHE.graphs) == [(G, 1)]
