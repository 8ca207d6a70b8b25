"""What cgx2 keeps per process group is one GroupState, dropped with the group; the settings are
a snapshot, read again only by config.refresh() (or changed by config.tuned())."""

import gc
import os
from unittest import mock

import torch
import torch.distributed as dist

from cgx2 import comm, config
from cgx2.collectives import policy
from cgx2.comm import groups

CPU = torch.device("cpu")


class _Resource:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_every_layers_state_of_a_group_is_one_object_dropped_with_it():
    group = dist.ProcessGroup(0, 2)
    state = comm.group_state(group)
    state.info = comm.GroupInfo("gloo", 2, 0, False, False, 1800.0)
    assert comm.group_info(group) is state.info
    chosen = policy.transport(CPU, group)
    assert state.transports == {CPU: chosen}
    route = policy.route(torch.zeros(4), group, 32, 512)
    assert [r.plain for r in state.routes.values()] == [route]
    resource = state.worker.value = _Resource()
    assert comm.group_state(group) is state
    del group
    gc.collect()
    assert all(other is not state for other in groups.states())
    assert resource.closed  # the group's resources go with it


def test_the_settings_are_read_once_until_refreshed():
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}):
        config.refresh()
        first, tuning = config.launch(), config.tuning()
        with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "4", "CGX2_CROSSOVER_BYTES": "7"}):
            assert config.launch() is first and not first.spans_nodes
            assert config.tuning() is tuning and config.crossover_override() is None
            config.refresh()
            assert config.launch().spans_nodes and config.crossover_override() == 7
    config.refresh()


def test_routes_decided_under_other_settings_are_decided_anew():
    group = dist.ProcessGroup(0, 2)
    state = comm.group_state(group)
    state.info = comm.GroupInfo("gloo", 2, 0, False, False, 1800.0)
    t = torch.zeros(1024)
    with config.tuned(crossover_bytes=0):
        assert policy.route(t, group, 4, 512).compress
        decided = dict(state.routes)
    with config.tuned(crossover_bytes=0, pair_gather=False):
        assert policy.route(t, group, 4, 512).compress
        assert state.routes != decided  # the pair's swap is no longer by all-gather
    policy.reset()
    assert not state.routes and not state.transports


def test_threads_asking_at_once_get_one_state():
    from concurrent.futures import ThreadPoolExecutor

    made = [dist.ProcessGroup(0, 2)]
    with ThreadPoolExecutor(8) as pool:
        found = list(pool.map(lambda _: comm.group_state(made[0]), range(64)))
    assert all(state is found[0] for state in found)
    made.clear()
    gc.collect()
    assert all(other is not found[0] for other in groups.states())
