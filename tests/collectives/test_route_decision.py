"""The policy's decision alone: plain facts in, a route out, with no process group, no
environment and no I/O (cgx2.collectives.decision)."""

import json
import os
import zlib

import pytest

from cgx2.collectives import decision
from cgx2.collectives.decision import CallFacts, GroupFacts
from cgx2.comm import process_group, shm

MiB = 1 << 20


def _group(**facts: object) -> GroupFacts:
    chosen = {"regime": "cpu", "world": 4, "element_size": 4, "bucket_size": 512, **facts}
    return GroupFacts(**chosen)


def _call(group: GroupFacts, numel: int, **facts: object) -> CallFacts:
    return CallFacts(group=group, bits=facts.pop("bits", 4), numel=numel, **facts)


def test_below_the_crossover_the_call_goes_plain_and_from_it_compressed():
    group = _group(regime="socket")
    at = 4 * MiB // 4
    assert not decision.decide(_call(group, at - 1, crossovers=(4 * MiB, 4 * MiB))).compress
    assert decision.decide(_call(group, at, crossovers=(4 * MiB, 4 * MiB))).compress


@pytest.mark.parametrize(
    "facts",
    [
        {"bits": 32, "numel": MiB},  # uncompressed asked for
        {"numel": 0},  # nothing to send
        {"numel": MiB, "crossovers": (None, None)},  # compression never pays
        {"numel": MiB, "world": 1},  # one rank
    ],
)
def test_what_is_never_compressed(facts):
    group = _group(world=facts.pop("world", 4))
    route = decision.decide(_call(group, **facts))
    assert not route.compress
    assert route == decision.plan(group).plain


def test_beside_the_training_step_the_second_crossover_and_its_pieces_hold():
    group = _group(spans_nodes=True)  # CPU tensors across nodes: small pieces alone
    alone = decision.decide(_call(group, MiB, crossovers=(0, None)))
    beside = decision.decide(_call(group, MiB, crossovers=(0, None), beside_compute=True))
    assert alone.compress and not beside.compress
    both = _call(group, MiB, crossovers=(0, 0), beside_compute=True)
    assert alone.piece_numel == decision.CPU_ACROSS_NODES_PIECE_NUMEL
    assert decision.decide(both).piece_numel == decision.PIECE_NUMEL["cpu"] // 2048 * 2048


def test_pieces_are_whole_buckets_for_every_rank():
    for pipeline_bytes in (None, 1000, 3 * MiB):
        group = _group(regime="shm", world=3, bucket_size=100, pipeline_bytes=pipeline_bytes)
        pieces = decision.decide(_call(group, MiB)).piece_numel
        assert pieces > 0 and pieces % 300 == 0
    facts = decision.GroupFacts("shm", 3, 4, 100, pipeline_bytes=3 * MiB)
    assert decision.piece_numel(facts, False, False) == 786300


@pytest.mark.parametrize(
    ("regime", "world", "algorithm", "expected"),
    [
        ("socket", 2, "auto", True),
        ("shm", 2, "auto", True),
        ("nvlink", 2, "auto", False),
        ("socket", 4, "auto", False),
        ("socket", 2, "ring", True),
    ],
)
def test_two_ranks_swap_by_all_gather_outside_nvlink(regime, world, algorithm, expected):
    group = _group(regime=regime, world=world, algorithm=algorithm)
    route = decision.decide(_call(group, MiB))
    assert route.pair_gather is expected
    assert not route.ring  # the ring needs more than two ranks
    assert (
        decision.decide(_call(_group(regime=regime, world=2, pair_gather=False), MiB)).pair_gather
        is False
    )


@pytest.mark.parametrize("world", [2, 4])
def test_gathering_all_is_taken_only_where_asked_and_may_replay_a_graph(world):
    """CGX2_ALGORITHM=allgather: every compressed route gathers all (two ranks or more), never
    the ring; it still replays CUDA graphs; its settings differ from the default's, so ranks
    that differ on it are told by the agreement check."""
    asked = _group(regime="socket", world=world, algorithm="allgather", nccl_cuda=True)
    route = decision.decide(_call(asked, MiB, cuda_graphs=True, graphs_usable=True))
    assert route.gather_all and not route.ring and route.graphs
    assert decision.gathers_all("allgather") and not decision.gathers_all("auto")
    default = decision.decide(_call(_group(regime="socket", world=world, nccl_cuda=True), MiB))
    assert not default.gather_all and default.fingerprint != route.fingerprint
    assert not decision.plan(asked).plain.compress


def test_the_ring_is_taken_only_where_asked_and_without_pair_gather_or_in_place_gathers():
    group = _group(regime="socket", world=4, algorithm="ring", nccl_cuda=True)
    route = decision.decide(_call(group, MiB, cuda_graphs=True, graphs_usable=True))
    assert route.ring and not route.pair_gather and not route.gather_in_place
    assert not route.graphs


@pytest.mark.parametrize(
    ("setting", "nccl_cuda", "world", "expected"),
    [
        ("auto", True, 4, ""),
        ("auto", False, 4, "now"),
        ("on", True, 4, "now"),
        ("off", False, 4, ""),
        ("deferred", False, 4, "deferred"),
        ("on", False, 1, ""),
    ],
)
def test_the_agreement_check(setting, nccl_cuda, world, expected):
    group = _group(check_agreement=setting, nccl_cuda=nccl_cuda, world=world)
    assert decision.plan(group).compressed.check == expected


def test_nccl_cuda_calls_replay_graphs_up_to_the_auto_limit_on_the_process_group_only():
    group = _group(regime="nvlink", nccl_cuda=True)
    limit = decision.GRAPHS_AUTO_MAX_BYTES // 4

    def route(numel: int, **facts: object) -> decision.Route:
        return decision.decide(_call(group, numel, graphs_usable=True, **facts))

    assert route(limit).graphs and route(limit).gather_in_place
    assert not route(limit + 1).graphs  # auto: large calls launch eagerly
    assert route(limit + 1, cuda_graphs=True).graphs
    assert not decision.decide(_call(group, limit)).graphs  # graphs not usable here
    shm_group = _group(regime="nvlink", nccl_cuda=True, transport=shm)
    assert decision.plan(shm_group).graphs is None
    assert decision.plan(_group(regime="socket")).graphs is None  # not NCCL's CUDA tensors


def test_the_settings_every_rank_must_share_are_named_with_their_crc():
    wire = {"CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS": False}
    group = _group(regime="shm", world=2, wire_settings=wire)
    route = decision.decide(_call(group, MiB))
    settings = json.loads(route.settings)
    assert settings == {
        **wire,
        "route.regime": "shm",
        "route.piece_numel": route.piece_numel,
        "route.pair_gather": True,
        "route.ring": False,
        "route.gather_all": False,
        "route.transport": "process_group",
    }
    assert route.fingerprint == zlib.crc32(route.settings.encode())
    assert route.transport is process_group
    other = decision.decide(_call(_group(regime="shm", world=2, transport=shm), MiB))
    assert other.fingerprint != route.fingerprint


def test_the_same_facts_give_the_same_route():
    facts = _call(_group(regime="socket", nccl_cuda=True), 3 * MiB, crossovers=(MiB, 2 * MiB))
    assert decision.decide(facts) == decision.decide(facts)


def test_the_built_in_crossovers_and_the_nearest_measured_size():
    assert decision.table_crossover("nvlink", 4, False) == 256 * MiB
    assert decision.table_crossover("nvlink", 2, False) is None
    assert decision.table_crossover("nvlink", 2, True) == 256 * MiB
    faster = {MiB: True, 16 * MiB: False}
    assert decision.nearest_size(faster, 0) is True
    assert decision.nearest_size(faster, 3 * MiB) is True
    assert decision.nearest_size(faster, 5 * MiB) is False


def test_the_decision_reads_nothing_but_its_facts():
    """decision.py imports neither the configuration, the process groups' state, the
    environment nor torch: what it decides comes from its arguments alone."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(decision.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            imported |= {"." * node.level + name for name in names}
    allowed = {"__future__.annotations", "dataclasses", "json", "math", "zlib"}
    allowed |= {"collections.abc.Mapping", "dataclasses.dataclass", "dataclasses.field"}
    allowed |= {"..comm.Transport", "..checks.UNCOMPRESSED_BITS", "..comm.process_group"}
    assert imported <= allowed, imported - allowed


@pytest.mark.parametrize("env", [{}, {"CGX2_ALGORITHM": "ring"}, {"CGX2_PIPELINE_BYTES": "3M"}])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_policy_routes_as_the_decision_decides_from_the_facts_it_gathers(
    monkeypatch, tmp_path, env, world
):
    """policy.route gathers a call's facts (regime, transport, settings, crossovers) and
    routes as decision.decide does from them: on a stand-in gloo group of CPU tensors."""
    import torch
    import torch.distributed as dist

    from cgx2 import comm, config
    from cgx2.collectives import policy

    for var in [v for v in os.environ if v.startswith(("CGX", "WORLD_SIZE", "LOCAL_WORLD"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("CGX2_CALIBRATION_FILE", str(tmp_path / "none.json"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    policy.reset()
    group = dist.ProcessGroup(0, world)
    comm.group_state(group).info = comm.GroupInfo("gloo", world, 0, False, False, 1800.0)
    try:
        tuning = config.tuning()
        cpu = torch.device("cpu")
        facts = GroupFacts(
            regime=policy.group_regime(cpu, group),
            world=world,
            element_size=4,
            bucket_size=512,
            transport=policy.transport(cpu, group),
            pair_gather=tuning.pair_gather,
            pipeline_bytes=tuning.pipeline_bytes,
            spans_nodes=False,
            algorithm=tuning.algorithm,
            check_agreement=tuning.check_agreement,
            wire_settings=config.wire_settings(),
        )
        crossover = policy.crossover_bytes(cpu, torch.float32, group)
        for numel in (0, 16, MiB):
            for bits in (2, 4, 32):
                call = _call(facts, numel, bits=bits, crossovers=(crossover, crossover))
                route = policy.route(torch.zeros(1), group, bits, 512, numel)
                assert route == decision.decide(call)
    finally:
        monkeypatch.undo()
        policy.reset()
