"""The automatic fallback: regime detection from NCCL's variables and the GPUs' peer access,
the crossover per regime and dtype, CGX2_CROSSOVER_BYTES, and the plain result below it."""

import os

import pytest
import torch
import torch.distributed as dist

import cgx2
from cgx2 import crossover, graphs
from cgx2.crossover import crossover_bytes, detect_regime

CUDA = torch.device("cuda", 0)
MiB = 1 << 20


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "CGX2_CROSSOVER_BYTES"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    crossover.regime.cache_clear()  # the regime is cached per device
    crossover._measured_crossover.cache_clear()
    yield monkeypatch
    crossover.regime.cache_clear()
    crossover._measured_crossover.cache_clear()


def test_regime_is_read_once_per_device(clean_env):
    """The threshold runs before every allreduce: the regime is detected once, while
    CGX2_CROSSOVER_BYTES stays live."""
    calls = []
    clean_env.setattr(crossover, "detect_regime", lambda device: calls.append(device) or "shm")
    for _ in range(3):
        assert crossover_bytes(CUDA, torch.float32) == 16 * MiB
    assert calls == [CUDA]
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "123")
    assert crossover_bytes(CUDA, torch.float32) == 123


@pytest.mark.parametrize(
    ("env", "peers", "regime"),
    [
        ({}, True, "nvlink"),
        ({}, False, "shm"),
        ({"NCCL_P2P_DISABLE": "1"}, True, "shm"),
        ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, True, "socket"),
        ({"NCCL_P2P_DISABLE": "0"}, True, "nvlink"),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True, "socket"),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, True, "nvlink"),
    ],
)
def test_regime_detection(clean_env, env, peers, regime):
    for k, v in env.items():
        clean_env.setenv(k, v)
    clean_env.setattr(crossover, "_peers_reachable", lambda: peers)
    assert detect_regime(CUDA) == regime
    assert detect_regime(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize(
    ("regime", "dtype", "expected"),
    [
        ("nvlink", torch.float32, 256 * MiB),
        ("nvlink", torch.bfloat16, None),
        ("nvlink", torch.float16, None),
        ("shm", torch.bfloat16, 16 * MiB),
        ("socket", torch.float32, 4 * MiB),
        ("cpu", torch.float32, 0),
    ],
)
def test_crossover_per_regime_and_dtype(clean_env, regime, dtype, expected):
    clean_env.setattr(crossover, "detect_regime", lambda device: regime)
    assert crossover_bytes(CUDA, dtype) == expected


@pytest.mark.parametrize(
    ("regime", "dtype", "expected"),
    [
        ("nvlink", torch.float32, 64 * MiB),
        ("nvlink", torch.bfloat16, 256 * MiB),
        ("shm", torch.float32, 4 * MiB),
        ("shm", torch.bfloat16, 16 * MiB),
        ("socket", torch.bfloat16, 4 * MiB),
    ],
)
def test_crossover_with_cuda_graphs(clean_env, regime, dtype, expected):
    """Replaying graphs costs the host less: compression pays from smaller sizes."""
    clean_env.setattr(crossover, "detect_regime", lambda device: regime)
    clean_env.setattr(graphs, "ENABLED", True)
    assert crossover_bytes(CUDA, dtype) == expected
    clean_env.setattr(graphs, "ENABLED", False)
    assert crossover_bytes(CUDA, dtype) == crossover.CROSSOVER_BYTES[regime][dtype.itemsize < 4]


def test_variable_overrides_and_is_checked(clean_env):
    clean_env.setattr(crossover, "detect_regime", lambda device: "nvlink")
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "0")
    assert crossover_bytes(CUDA, torch.bfloat16) == 0
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "auto")
    assert crossover_bytes(CUDA, torch.bfloat16) is None
    for bad in ("-1", "1MB"):
        clean_env.setenv("CGX2_CROSSOVER_BYTES", bad)
        with pytest.raises(ValueError, match="CGX2_CROSSOVER_BYTES"):
            crossover_bytes(CUDA, torch.float32)


def _below_and_above_crossover() -> list[bool]:
    """With the crossover at 16 KiB: 4095 fp32 values go plain (exact), 4096 are quantized."""
    os.environ["CGX2_CROSSOVER_BYTES"] = str(16 << 10)
    try:
        out = []
        for n in (4095, 4096):
            x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
            exact = x.clone()
            dist.all_reduce(exact)
            out.append(torch.equal(cgx2.quantized_allreduce(x, 4, seed=1), exact))
            op = torch.ops.cgx.quantized_allreduce(x, 4, 512, "", "sum", 1, False)
            out.append(torch.equal(op, exact))
        return out
    finally:
        del os.environ["CGX2_CROSSOVER_BYTES"]


def test_below_the_crossover_the_result_is_the_plain_allreduce(dist2):
    assert dist2.run(_below_and_above_crossover) == [[True, True, False, False]] * 2


def _hook_and_backend_below_the_crossover() -> list[bool]:
    """With a crossover larger than anything here, the hook and the backend send exactly."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx2.ddp import CGXState, cgx_hook

    os.environ.update(CGX2_CROSSOVER_BYTES=str(1 << 30), CGX_COMPRESSION_QUANTIZATION_BITS="4")
    try:
        group = dist.new_group(backend="cgx")
        x = torch.randn(100_000, generator=torch.Generator().manual_seed(dist.get_rank()))
        exact, got = x.clone(), x.clone()
        dist.all_reduce(exact)
        dist.all_reduce(got, group=group)
        checks = [torch.equal(got, exact), group.bytes_sent == group.bytes_uncompressed]
        model = DDP(torch.nn.Linear(256, 256))
        state = CGXState(None, 1024, {"bits": 4})
        model.register_comm_hook(state, cgx_hook)
        model(torch.randn(8, 256)).sum().backward()
        checks.append(state.bytes_sent == state.bytes_uncompressed > 0)
        dist.destroy_process_group(group)
        return checks
    finally:
        del os.environ["CGX2_CROSSOVER_BYTES"], os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"]


def test_hook_and_backend_fall_back_in_place(dist2):
    assert dist2.run(_hook_and_backend_below_the_crossover) == [[True, True, True]] * 2


def test_fallback_calls_the_group_synchronously_and_accepts_no_work(monkeypatch):
    """Below the crossover the process group's allreduce runs as ``dist.all_reduce`` runs it
    (``asyncOp`` False, where torch has the field); NCCL then returns no Work object."""
    from cgx2 import collectives

    calls = []

    class Group:
        def allreduce(self, tensors, options):
            calls.append(options)
            tensors[0].add_(1)
            return None

    monkeypatch.setattr(collectives, "_plain_route", lambda group: (None, True))
    t = torch.zeros(4)
    assert collectives.allreduce_plain_(t, Group(), "sum") is t
    assert torch.equal(t, torch.ones(4))
    assert calls[0].reduceOp == dist.ReduceOp.SUM
    assert getattr(calls[0], "asyncOp", False) is False


def test_a_regime_where_compression_never_won_never_compresses(clean_env):
    clean_env.setattr(crossover, "detect_regime", lambda device: "nvlink")
    clean_env.setitem(crossover.CROSSOVER_BYTES, "nvlink", (256 * MiB, None))
    assert crossover_bytes(CUDA, torch.float16) is None
    assert crossover_bytes(CUDA, torch.float32) == 256 * MiB


def test_plain_route_is_looked_up_once_per_group_and_dropped_with_it(monkeypatch):
    import gc

    from cgx2 import collectives

    backends = []

    def get_backend(group):
        backends.append(group)
        return "nccl"

    monkeypatch.setattr(collectives.dist, "get_backend", get_backend)

    class Group:
        pass

    group = Group()
    assert collectives._plain_route(group) == (None, True)
    assert collectives._plain_route(group) == (None, True)
    assert len(backends) == 1 and id(group) in collectives._ROUTES
    key = id(group)
    del group, backends[:]
    gc.collect()
    assert key not in collectives._ROUTES


@pytest.mark.parametrize("cuda_on_nccl", [True, False])
def test_a_cgx_group_routes_exactly_and_says_whether_nccl_carries_cuda(monkeypatch, cuda_on_nccl):
    """The cgx group's fallback is its own exact allreduce; CUDA graphs (which capture NCCL's
    launches only) may replay on it where NCCL carries its CUDA tensors."""
    from cgx2 import collectives

    monkeypatch.setattr(collectives.dist, "get_backend", lambda group: "cgx")

    class CGXGroup:
        def allreduce_exact(self, tensor, reduce_op):
            raise AssertionError("not called here")

    group = CGXGroup()
    group.cuda_on_nccl = cuda_on_nccl
    exact, nccl = collectives._plain_route(group)
    assert exact == group.allreduce_exact and nccl is cuda_on_nccl


def test_group_size_and_rank_are_looked_up_once_per_group_and_dropped_with_it():
    import gc

    from cgx2 import collectives

    calls = []

    class Group(dist.ProcessGroup):
        def size(self):
            calls.append("size")
            return 3

        def rank(self):
            calls.append("rank")
            return 2

    group = Group(2, 3)
    assert collectives.group_size_and_rank(group) == (3, 2)
    assert collectives.group_size_and_rank(group) == (3, 2)
    assert calls == ["size", "rank"]
    key = id(group)
    del group
    gc.collect()
    assert key not in collectives._SIZE_RANK
