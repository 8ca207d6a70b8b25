"""The process-group transport satisfies the Transport protocol the collectives call, name for
name and parameter for parameter."""

import importlib
import inspect
from unittest import mock

import pytest

from cgx2.comm import Transport, process_group, shm
from cgx2.comm.base import TRANSPORT_FUNCTIONS
from cgx2.config import tuned


def _parameters(fn) -> list[tuple[str, object]]:
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return [(p.name, p.default) for p in params]


def test_the_process_group_transport_is_a_transport():
    assert isinstance(process_group, Transport)
    wanted = [n for n, v in vars(Transport).items() if callable(v) and not n.startswith("_")]
    assert len(wanted) == 8 and sorted(wanted) == sorted(TRANSPORT_FUNCTIONS)
    for name in wanted:
        assert _parameters(getattr(process_group, name)) == _parameters(getattr(Transport, name))


@pytest.mark.parametrize("name", ["shm", "nccl"])
def test_cgx2s_transports_are_transports(name):
    module = importlib.import_module(f"cgx2.comm.{name}")
    assert isinstance(module, Transport)
    assert set(TRANSPORT_FUNCTIONS) <= set(module.__all__)  # exported, as the protocol's
    for call in [n for n, v in vars(Transport).items() if callable(v) and not n.startswith("_")]:
        assert _parameters(getattr(module, call)) == _parameters(getattr(Transport, call)), call


def test_the_nccl_transport_without_nccl_falls_back():
    """On a machine without NCCL (CI), choosing it routes through the process group."""
    import torch

    from cgx2.collectives import policy
    from cgx2.comm import nccl

    if torch.cuda.is_available():
        pytest.skip("NCCL is loaded on a GPU machine")
    assert not nccl.available()
    with tuned(transport="nccl"):
        assert policy.transport(torch.device("cpu"), None) is process_group


def test_a_module_lacking_a_call_is_not_a_transport():
    import types

    partial = types.SimpleNamespace(
        **{n: getattr(process_group, n) for n in ("all_to_all", "all_gather", "wait")}
    )
    assert not isinstance(partial, Transport)


def _every_rank_found_all(pools: tuple, fn: object, *args: object) -> None:
    """``fn(*args)`` run by every rank of each pool: each rank's list of checks all true."""
    for pool in pools:
        for rank_found in pool.run(fn, *args):
            assert all(rank_found), rank_found


def _gathers_in_parts(n: int) -> list[bool]:
    """gloo's all-gather of more than GLOO_SPLIT_BYTES, run as several concurrent ones: every
    rank's bytes land in its slot, whatever the dtype and however the parts divide; an input
    inside the output (in place) is gathered whole."""
    import torch
    import torch.distributed as dist

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    found = []
    for dtype in (torch.uint8, torch.float32):
        send = (torch.arange(n) * (rank + 1) % 251).to(dtype)
        want = torch.cat([(torch.arange(n) * (r + 1) % 251).to(dtype) for r in range(world)])
        out = torch.full((world * n,), 255, dtype=dtype)
        spy = mock.patch.object(
            process_group, "all_gather_in_parts", wraps=process_group.all_gather_in_parts
        )
        with mock.patch.object(process_group, "GLOO_SPLIT_BYTES", 1024), spy as split:
            process_group.wait(process_group.all_gather(out, send, group, async_op=False))
            found += [torch.equal(out, want), split.call_args.args[3] == 4]
            in_place = want.clone()
            in_place.view(world, n)[rank].zero_()
            own = in_place.view(world, n)[rank]
            own.copy_(send)
            process_group.wait(process_group.all_gather(in_place, own, group, async_op=False))
            found += [torch.equal(in_place, want), split.call_count == 1]
    return found


def test_gloo_all_gathers_split_into_concurrent_parts(dist2, dist4):
    _every_rank_found_all((dist2, dist4), _gathers_in_parts, 10_001)


def _async_plain(n: int) -> list[bool]:
    """The process group's plain allreduce left running: a future of the tensor itself, the
    same bits as the call waited for, and two running at once
    end as they were started."""
    import torch
    import torch.distributed as dist

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    found = []
    for op in ("sum", "avg"):
        a = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        b = a.flip(0).clone()
        want_a, want_b = a.clone(), b.clone()
        process_group.allreduce_plain_(want_a, group, op)
        process_group.allreduce_plain_(want_b, group, op)
        running = [process_group.allreduce_plain_async_(t, group, op) for t in (a, b)]
        found += [f.wait() is t for f, t in zip(running, (a, b), strict=True)]
        found += [torch.equal(a, want_a), torch.equal(b, want_b)]
        total = sum(
            torch.randn(n, generator=torch.Generator().manual_seed(r)) * (r + 1)
            for r in range(world)
        )
        found.append(torch.allclose(a, total / world if op == "avg" else total, atol=1e-5))
    # Where shared memory serves the group (one host), its copies run at once.
    c = torch.ones(n)
    done = shm.allreduce_plain_async_(c, group, "sum")
    found.append(done.done() or not shm.serves(group))
    found.append(done.wait() is c and torch.equal(c, torch.full((n,), float(world))))
    return found


def test_the_plain_allreduce_left_running_is_the_one_waited_for(dist2, dist4):
    _every_rank_found_all((dist2, dist4), _async_plain, 10_001)


def _average_of_three(n: int) -> list[bool]:
    """AVG on gloo over three ranks (where dividing before or after the sum rounds apart),
    waited for and left running: both DDP's own bits, each rank's share divided by 3 first."""
    import torch
    import torch.distributed as dist

    three = dist.new_group([0, 1, 2])
    if dist.get_rank() == 3:
        return [True]
    x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    ddp = x.div(3)
    dist.all_reduce(ddp, group=three)
    waited, running = x.clone(), x.clone()
    process_group.allreduce_plain_(waited, three, "avg")
    process_group.allreduce_plain_async_(running, three, "avg").wait()
    summed_first = x.clone()
    dist.all_reduce(summed_first, group=three)
    return [
        torch.equal(waited, ddp),
        torch.equal(running, ddp),
        not torch.equal(summed_first.div_(3), ddp),
    ]


def test_the_plain_average_divides_first_as_ddps_own(dist4):
    for rank_found in dist4.run(_average_of_three, 10_001):
        assert all(rank_found), rank_found
