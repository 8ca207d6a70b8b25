"""examples/torchtitan_fsdp.py on 2 gloo processes: a torchtitan-style parallelize() (per-block
fully_shard, bf16 parameters, HSDP on a 2-D mesh) followed by cgx2.fsdp.compress trains, and
the ranks agree. torch.compile stays off: compiling on these CPUs takes longer than the run."""

import pytest
from recipes import agree, run_recipe

pytestmark = pytest.mark.slow  # each test starts 2 processes

STEPS = "3"


def test_fsdp2_bf16_with_quantized_all_gather(tmp_path):
    """1-D mesh over both ranks, bf16 parameters, 4-bit reduce-scatter and 8-bit parameter
    all-gather: under a quarter of FSDP2's own reduce-scatter bytes, same parameters."""
    result = run_recipe(tmp_path, "torchtitan_fsdp.py", "--steps", STEPS, "--param-bits", "8")
    agree(result)
    for r in result["ranks"]:
        assert r["replicas"] == 1 and r["steps"] == int(STEPS)
        assert 0 < r["bytes_sent"] < r["bytes_uncompressed"] / 4, r


def test_hsdp_replicas_quantized(tmp_path):
    """HSDP, 2 replicas of 1 shard: the gradients cross replicas only by FSDP2's all-reduce,
    which cgx2 quantizes. Both replicas hold the same parameters, and they are not those of
    the same run with FSDP2's own all-reduce (--bits 32): the quantized all-reduce ran."""
    args = ("--steps", "1", "--replicas", "2")
    quantized = run_recipe(tmp_path, "torchtitan_fsdp.py", *args, "--bits", "4")
    exact = run_recipe(tmp_path, "torchtitan_fsdp.py", *args, "--bits", "32")
    agree(quantized)
    agree(exact)
    assert quantized["ranks"][0]["digest"] != exact["ranks"][0]["digest"]
