"""DDP's hooks compare the ranks' settings once, at their first call: ranks whose settings would
send different bytes raise DisagreementError naming each, instead of training on wrong
gradients; ranks that agree pay nothing more per step."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from env_vars import setenv
from torch.nn.parallel import DistributedDataParallel as DDP
from toy_task import TwoLayers

from cgx2 import config
from cgx2.collectives import agreement
from cgx2.ddp import CGXState, GlobalQSGDState, PowerSGDState, cgx_hook, global_qsgd, lgreco_hook


class _Net(TwoLayers):
    """A compressed 288 x 64 layer, small exact ones around it: several buckets."""

    def __init__(self) -> None:
        super().__init__(288, 64)


def _hooked(hook: str, settings: dict) -> tuple[object, object]:
    """The (state, hook) of ``hook`` with ``settings``."""
    if hook == "cgx":
        return CGXState(None, **{"compression_params": {"bits": 4}, **settings}), cgx_hook
    if hook == "powerSGD":
        return PowerSGDState(None, **{"start_powerSGD_iter": 2, **settings}), lgreco_hook
    return GlobalQSGDState(**settings), getattr(global_qsgd, hook)


def _backward(
    hook: str, settings: tuple[dict, dict], env: tuple[dict, dict] = ({}, {}), steps: int = 1
) -> tuple[str, str, int]:
    """``steps`` backward passes of DDP with ``hook`` and this rank's ``settings`` and
    environment: the error's type and message ("", "" where none), and how many times the
    ranks' settings were compared."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    compared = mock.patch.object(agreement, "check_settings", wraps=agreement.check_settings)
    try:
        with setenv(**env[rank]), compared as check:
            config.reload()
            model = DDP(_Net(), bucket_cap_mb=0.02)
            model.register_comm_hook(*_hooked(hook, settings[rank]))
            for step in range(steps):
                x = torch.randn(16, 288, generator=torch.Generator().manual_seed(step + rank))
                model(x).square().mean().backward()
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e), check.call_count
    finally:
        config.reload()
    return "", "", check.call_count


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            ({"compression_params": {"bits": 4}}, {"compression_params": {"bits": 8}}),
            "bits=[rank 0: 4, rank 1: 8]",
        ),
        (
            ({"compression_params": {"bits": 4, "bucket_size": 128}}, {}),
            "bucket_size=[rank 0: 128, rank 1: 512]",
        ),
        (
            ({"layer_min_size": 1024}, {"layer_min_size": 100_000}),
            "layer_min_size=[rank 0: 1024, rank 1: 100000]",
        ),
        (({}, {"error_feedback": True}), "error_feedback=[rank 0: False, rank 1: True]"),
        (({}, {"adaptive_bits": (2, 4)}), "adaptive_bits=[rank 0: None, rank 1: [2, 4]]"),
        (({"start_iter": 0}, {}), "start_iter=[rank 0: 0, rank 1: 1]"),
    ],
)
def test_cgx_hooks_whose_settings_differ_raise_on_every_rank(dist2, settings, expected):
    """Before, 4 bits on one rank and 8 on the other trained on, each rank on gradients of its
    own, wrong by up to 8 times their range."""
    for rank, (kind, message, _) in enumerate(dist2.run(_backward, "cgx", settings)):
        assert kind == "DisagreementError", message
        assert expected in message and f"this rank {rank}:" in message, message


def test_a_hook_names_a_variable_that_changes_the_bytes(dist2):
    env = ({"CGX2_PIPELINE_BYTES": "64K"}, {"CGX2_PIPELINE_BYTES": "128K"})
    for kind, message, _ in dist2.run(_backward, "cgx", ({}, {}), env):
        assert kind == "DisagreementError", message
        assert "CGX2_PIPELINE_BYTES=[rank 0: 65536, rank 1: 131072]" in message, message


@pytest.mark.parametrize("hook", ["cgx", "standard_dithering_hook", "powerSGD"])
def test_ranks_that_agree_compare_once_and_train_on(dist2, hook):
    for kind, message, compared in dist2.run(_backward, hook, ({}, {}), ({}, {}), 3):
        assert (kind, message, compared) == ("", "", 1)


@pytest.mark.parametrize(
    ("hook", "settings", "expected"),
    [
        ("standard_dithering_hook", ({"bits": 4}, {"bits": 8}), "bits=[rank 0: 4, rank 1: 8]"),
        (
            "qsgd_hook",
            ({}, {"error_feedback": True}),
            "error_feedback=[rank 0: False, rank 1: True]",
        ),
        (
            "powerSGD",
            ({"matrix_approximation_rank": 1}, {"matrix_approximation_rank": 2}),
            "matrix_approximation_rank=[rank 0: 1, rank 1: 2]",
        ),
        ("powerSGD", ({"random_seed": 0}, {"random_seed": 1}), "random_seed=[rank 0: "),
    ],
)
def test_global_qsgd_and_powersgd_hooks_whose_settings_differ_raise(
    dist2, hook, settings, expected
):
    for rank, (kind, message, _) in enumerate(dist2.run(_backward, hook, settings)):
        assert kind == "DisagreementError", message
        assert expected in message and f"this rank {rank}:" in message, message


def _different_hooks() -> tuple[str, str]:
    """A state of a group (as of None) is made afresh at every call: the group remembers
    which hooks its ranks compared. A new group, so that no earlier test's hook counts."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    group = dist.new_group(backend="gloo")
    model = DDP(_Net(), bucket_cap_mb=0.02, process_group=group)
    model.register_comm_hook(
        group, (global_qsgd.standard_dithering_hook, global_qsgd.thc_hook)[rank]
    )
    try:
        model(torch.randn(16, 288)).square().mean().backward()
    except Exception as e:  # reported to the test
        return type(e).__name__, str(e)
    finally:
        dist.destroy_process_group(group)
    return "", ""


def test_ranks_that_run_different_global_qsgd_hooks_raise_naming_them(dist2):
    for kind, message in dist2.run(_different_hooks):
        assert kind == "DisagreementError", message
        assert "hook=[rank 0: standard_dithering, rank 1: thc]" in message, message
