"""examples/lightning_ddp.py and lightning_fsdp.py on 2 gloo processes under torchrun: cgx2's
DDP hooks and FSDP2 reduce-scatter run inside Lightning's Trainer, and the ranks end with the
same parameters."""

import pytest
import torch
from recipes import agree, run_recipe

pytest.importorskip(
    "lightning", reason="lightning is not installed: pip install -e '.[integrations]'"
)

pytestmark = pytest.mark.slow  # each test starts 2 processes that import Lightning

STEPS = "4"


def test_cgx_hook_through_a_callback(tmp_path):
    """CGXState/cgx_hook, registered on the DDP model Lightning made: compressed from the
    second step (start_iter=1), under half of uncompressed DDP's bytes, same parameters."""
    result = run_recipe(tmp_path, "lightning_ddp.py", "--accelerator", "cpu", "--steps", STEPS)
    agree(result)
    for r in result["ranks"]:
        assert r["hook"] == "cgx" and r["via"] == "callback" and r["steps"] == int(STEPS)
        assert 0 < r["bytes_sent"] < r["bytes_uncompressed"] / 2, r


def test_global_qsgd_hook(tmp_path):
    """Global-QSGD's standard dithering at 4 bits through the same callback."""
    args = ("--accelerator", "cpu", "--steps", STEPS, "--hook", "gqsgd", "--bits", "4")
    result = run_recipe(tmp_path, "lightning_ddp.py", *args)
    agree(result)
    for r in result["ranks"]:
        assert r["hook"] == "gqsgd" and r["steps"] == int(STEPS)
        assert 0 < r["bytes_sent"] < r["bytes_uncompressed"] / 2, r


def test_strategy_arguments_are_ignored_on_cpus(tmp_path):
    """docs/integrations.md's caveat, held to the pinned Lightning: DDPStrategy(ddp_comm_state,
    ddp_comm_hook) registers nothing on CPU devices (its _register_ddp_hooks checks for CUDA),
    so the hook never runs: the reason the recipe registers it from a callback there."""
    result = run_recipe(
        tmp_path, "lightning_ddp.py", "--accelerator", "cpu", "--steps", "2", "--via", "strategy"
    )
    agree(result)
    assert all(r["bytes_sent"] == 0 for r in result["ranks"]), result["ranks"]


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...) registers the hook only on CUDA "
    "devices (lightning's DDPStrategy._register_ddp_hooks): needs 2 GPUs",
)
def test_strategy_arguments_on_gpus(tmp_path):
    """Lightning's own arguments on 2 GPUs (NCCL, under torchrun): the hook compresses."""
    result = run_recipe(
        tmp_path, "lightning_ddp.py", "--accelerator", "gpu", "--steps", STEPS, gpus=True
    )
    agree(result)
    for r in result["ranks"]:
        assert r["via"] == "strategy" and 0 < r["bytes_sent"] < r["bytes_uncompressed"] / 2, r


def test_fsdp2_through_model_parallel_strategy(tmp_path):
    """ModelParallelStrategy: fully_shard then cgx2.fsdp.compress in configure_model; the
    reduce-scatters send under a quarter of FSDP2's own bytes at 4 bits, and the gathered
    parameters agree."""
    result = run_recipe(tmp_path, "lightning_fsdp.py", "--accelerator", "cpu", "--steps", STEPS)
    agree(result)
    for r in result["ranks"]:
        assert r["bits"] == 4 and r["steps"] == int(STEPS)
        assert 0 < r["bytes_sent"] < r["bytes_uncompressed"] / 4, r
