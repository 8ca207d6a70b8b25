"""examples/accelerate_ddp.py and accelerate_fsdp.py on 2 processes under torchrun: cgx2's DDP
hooks registered on the model accelerator.prepare returns run, and the ranks agree."""

import pytest
import torch
from recipes import agree, run_recipe

pytest.importorskip(
    "accelerate", reason="accelerate is not installed: pip install -e '.[integrations]'"
)

pytestmark = pytest.mark.slow  # each test starts 2 processes that import Accelerate

STEPS = "4"


def test_cgx_hook_on_the_prepared_model(tmp_path):
    """CGXState/cgx_hook on the DDP model prepare() returned (MULTI_CPU, gloo): compressed from
    the second step, under half of uncompressed DDP's bytes, same parameters on both ranks."""
    result = run_recipe(tmp_path, "accelerate_ddp.py", "--cpu", "--steps", STEPS)
    agree(result)
    for r in result["ranks"]:
        assert r["distributed_type"] == "DistributedType.MULTI_CPU" and r["steps"] == int(STEPS)
        assert r["hook"] == "cgx" and 0 < r["bytes_sent"] < r["bytes_uncompressed"] / 2, r


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="Accelerate 1.15 runs FSDP2 only on accelerator devices: AcceleratorState sets "
    "DistributedType.FSDP for MULTI_GPU/MLU/SDAA/MUSA/NPU/XPU/HPU/NEURON, never MULTI_CPU, so "
    "on 2 CPU processes the fsdp_plugin is ignored and prepare() returns DDP (the example "
    "refuses that); needs 2 GPUs",
)
def test_fsdp2_through_the_plugin(tmp_path):
    """FullyShardedDataParallelPlugin(fsdp_version=2), then cgx2.fsdp.compress on the prepared
    model: the reduce-scatters send under a quarter of FSDP2's own bytes at 4 bits."""
    result = run_recipe(tmp_path, "accelerate_fsdp.py", "--steps", STEPS, gpus=True)
    agree(result)
    for r in result["ranks"]:
        assert r["distributed_type"] == "DistributedType.FSDP"
        assert 0 < r["bytes_sent"] < r["bytes_uncompressed"] / 4, r
