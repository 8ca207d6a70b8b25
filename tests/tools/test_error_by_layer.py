"""examples/error_by_layer.py, tiny, on the CPU: every layer's share and relative error at each
width, plain and rotated, narrower widths erring more, exact layers none, the error-to-noise
ratios, and its JSON; the study's compressors through their DDP hooks in two processes."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import error_by_layer

TINY = (
    "--dim 32 --layers 1 --heads 2 --context 32 --batch-size 4 --train-bytes 200000 --steps 3"
).split()
AT3 = [*TINY, "--at", "3"]


def test_each_layer_errs_more_at_fewer_bits_and_exact_layers_not_at_all(tmp_path, capsys):
    result = error_by_layer.main([*TINY, "--at", "0,3", "--out", str(tmp_path)])
    assert [m["step"] for m in result["measured"]] == [0, 3]
    for m in result["measured"]:
        rows = {r["layer"]: r for r in m["rows"]}
        whole = rows.pop("the whole gradient")
        assert sum(r["grad_share"] for r in rows.values()) == pytest.approx(1)
        assert sum(r["error_share"] for r in rows.values()) == pytest.approx(1)
        assert rows["head.weight"]["compressed"] and not rows["blocks.*.norm1.bias"]["compressed"]
        for r in rows.values():
            if r["compressed"]:
                assert r["rel_err_2"] > r["rel_err_3"] > r["rel_err_4"] > r["rel_err_8"] > 0, r
                assert r["rel_err_2_rot"] > r["rel_err_3_rot"] > r["rel_err_4_rot"] > 0, r
                assert r["err_to_noise_2_rot"] == pytest.approx(
                    r["rel_err_2_rot"] / r["batch_noise"]
                )
            else:
                assert r["rel_err_2"] is r["rel_err_8_rot"] is None and r["error_share"] == 0, r
        # 8 bits err well below the noise of the batches themselves, 2 bits well above it
        assert whole["rel_err_8"] < whole["batch_noise"] < whole["rel_err_2"]
        # the rotation spreads this model's outliers: at 2 bits, the error more than halves
        assert whole["rel_err_2_rot"] < 0.6 * whole["rel_err_2"]
        assert whole["err_to_noise_2"] == pytest.approx(whole["rel_err_2"] / whole["batch_noise"])
    (path,) = tmp_path.glob("error_by_layer_*.json")
    assert json.loads(path.read_text())["measured"] == result["measured"]
    printed = capsys.readouterr().out
    assert "after 3 steps:" in printed and "rel. err 2-bit rot" in printed
    ratio = result["measured"][-1]["rows"][-1]["err_to_noise_2_rot"]
    assert "error-to-noise ratio, the whole gradient: 2-bit " in printed
    assert f"2-bit rot {ratio:.2f}" in printed


def test_rotated_only_and_a_block_the_bucket_does_not_take(tmp_path):
    result = error_by_layer.main(
        [*TINY, "--at", "3", "--bits", "2", "--rotation", "hadamard", "--out", str(tmp_path)]
    )
    whole = result["measured"][0]["rows"][-1]
    assert "rel_err_2_rot" in whole and "rel_err_2" not in whole
    with pytest.raises(SystemExit):
        error_by_layer.parse_args([*TINY, "--rotation-block", "1024"])  # > --bucket-size 512


def test_steps_to_measure_must_lie_within_the_run():
    with pytest.raises(SystemExit):
        error_by_layer.parse_args([*TINY, "--at", "4"])


def test_the_study_s_compressors_through_their_ddp_hooks(tmp_path, capsys):
    """Two processes: plain DDP's average is the ranks' exact mean to the bit, CGX's 4-bit
    hook errs as the reference model's 4 bits do and less than its 2-bit one, PowerSGD is past
    its start (it sends less than fp32) after the warm-up passes."""
    hooked = "plain,cgx4,cgx2,powersgd"
    result = error_by_layer.main(
        [*TINY, "--at", "3", "--ranks", "2", "--compressors", hooked, "--out", str(tmp_path)]
    )
    (m,) = result["measured"]
    assert m["hook_warmup"] == 12
    hooked = {c["compressor"]: c for c in m["compressors"]}
    assert list(hooked) == ["plain", "cgx4", "cgx2", "powersgd"]
    rows = {r["layer"]: r for r in m["rows"]}
    whole = rows["the whole gradient"]
    assert hooked["plain"]["rel_err"] == 0 and hooked["plain"]["bits_per_value"] == 32
    assert 0 < hooked["cgx4"]["rel_err"] < hooked["cgx2"]["rel_err"]
    # the same gradients as the reference model's, in DDP's buckets with other rounding
    assert hooked["cgx4"]["rel_err"] == pytest.approx(whole["rel_err_4"], rel=0.15)
    assert hooked["cgx2"]["rel_err"] == pytest.approx(whole["rel_err_2"], rel=0.15)
    assert hooked["cgx4"]["bits_per_value"] < 8 and hooked["powersgd"]["bits_per_value"] < 32
    assert 0 < hooked["powersgd"]["rel_err"] < 1
    for c in hooked.values():
        assert c["err_to_noise"] == pytest.approx(c["rel_err"] / whole["batch_noise"])
        assert whole[f"rel_err_{c['compressor']}"] == c["rel_err"]
    # CGX sends a layer this small exact; it quantizes the head
    assert rows["head.bias"]["rel_err_cgx4"] == 0 < rows["head.weight"]["rel_err_cgx4"]
    (path,) = tmp_path.glob("error_by_layer_*_w2_*.json")
    assert json.loads(path.read_text())["measured"] == result["measured"]
    printed = capsys.readouterr().out
    assert "through each compressor's DDP hook (2 ranks, 12 warm-up passes first" in printed
    assert f"PowerSGD rank 4  {hooked['powersgd']['rel_err']:8.4f}" in printed


def test_compressors_are_the_study_s_ddp_ones():
    every = error_by_layer.parse_args([*AT3, "--compressors", "all"]).compressors
    assert "fsdp4" not in every and {"plain", "cgx2.5a-rot", "sd4", "lgreco"} <= set(every)
    for wrong in ("fsdp4", "cgx5"):  # FSDP2's has no DDP hook; no such compressor
        with pytest.raises(SystemExit):
            error_by_layer.parse_args([*AT3, "--compressors", wrong])


def test_under_torchrun_the_ranks_are_its_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert error_by_layer.parse_args([*AT3, "--compressors", "cgx4"]).ranks == 4
    with pytest.raises(SystemExit):
        error_by_layer.parse_args([*AT3, "--compressors", "cgx4", "--ranks", "2"])
    with pytest.raises(SystemExit):  # the widths alone: one process
        error_by_layer.parse_args(AT3)
