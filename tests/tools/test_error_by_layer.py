"""examples/error_by_layer.py, tiny, on the CPU: every layer's share and relative error at each
width, plain and rotated, narrower widths erring more, exact layers none, the error-to-noise
ratios, and its JSON."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import error_by_layer

TINY = (
    "--dim 32 --layers 1 --heads 2 --context 32 --batch-size 4 --train-bytes 200000 --steps 3"
).split()


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
