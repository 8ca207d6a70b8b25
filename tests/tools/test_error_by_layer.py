"""examples/error_by_layer.py, tiny, on the CPU: every layer's share and relative error at each
width, narrower widths erring more, exact layers none, and its JSON."""

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
                assert r["rel_err_2"] > r["rel_err_4"] > r["rel_err_8"] > 0, r
            else:
                assert r["rel_err_2"] is r["rel_err_8"] is None and r["error_share"] == 0, r
        # 8 bits err well below the noise of the batches themselves, 2 bits well above it
        assert whole["rel_err_8"] < whole["batch_noise"] < whole["rel_err_2"]
    (path,) = tmp_path.glob("error_by_layer_*.json")
    assert json.loads(path.read_text())["measured"] == result["measured"]
    assert "after 3 steps:" in capsys.readouterr().out


def test_steps_to_measure_must_lie_within_the_run():
    with pytest.raises(SystemExit):
        error_by_layer.parse_args([*TINY, "--at", "4"])
