"""``python -m cgx2.bench calibrate``: the crossover it derives from measurements, and a real run
on two gloo ranks (under torchrun, as users run it) that writes the file the policy reads."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
from test_bench_cli import _torchrun

from cgx2.bench.calibrate import crossover, crossovers, default_sizes, write_calibration
from cgx2.collectives.measure import CPU_MARGIN

K, M = 1 << 10, 1 << 20


def _m(nbytes: int, plain: float, compressed: float, dtype: str = "fp32") -> dict:
    return {"dtype": dtype, "bytes": nbytes, "plain_s": plain, "compressed_s": compressed}


def test_crossover_is_where_compression_wins_from_then_on() -> None:
    # Wins at 1M and above: compress from 1M.
    assert crossover([_m(64 * K, 1, 2), _m(M, 2, 1), _m(4 * M, 4, 1)]) == M
    # A win below a loss does not count: only the unbroken run up to the largest size does.
    assert crossover([_m(64 * K, 2, 1), _m(M, 1, 2), _m(4 * M, 4, 1)]) == 4 * M
    assert crossover([_m(64 * K, 2, 1), _m(M, 2, 1)]) == 64 * K  # wins everywhere measured
    assert crossover([_m(64 * K, 2, 1), _m(M, 1, 2)]) is None  # loses at the largest: never
    assert crossover([_m(M, 1, 1)]) is None  # a tie is no win
    # The order of the measurements does not matter.
    assert crossover([_m(4 * M, 4, 1), _m(64 * K, 1, 2), _m(M, 2, 1)]) == M
    # With a margin, compressed must be that many times faster.
    assert crossover([_m(M, 1.4, 1), _m(4 * M, 1.6, 1)], margin=1.5) == 4 * M
    assert crossover([_m(M, 1.6, 1), _m(4 * M, 1.4, 1)], margin=1.5) is None


def test_crossovers_are_per_element_width() -> None:
    rows = [_m(M, 2, 1), _m(4 * M, 2, 1), _m(M, 1, 2, "bf16"), _m(4 * M, 2, 1, "bf16")]
    assert crossovers(rows, "cuda", "gloo") == {"cuda/gloo/fp32": M, "cuda/gloo/16bit": 4 * M}
    # bf16 and fp16 are one width: a size wins only where both won.
    rows = [_m(M, 2, 1, "bf16"), _m(M, 1, 2, "fp16"), _m(4 * M, 2, 1, "fp16")]
    assert crossovers(rows, "cpu", "gloo") == {"cpu/gloo/16bit": 4 * M}


def test_default_ladder() -> None:
    assert default_sizes("cuda") == [64 * K, 256 * K, M, 4 * M, 16 * M, 64 * M, 256 * M]
    assert default_sizes("cpu") == [64 * K, 256 * K, M, 4 * M, 16 * M, 64 * M]


def test_write_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "calibration.json"
    write_calibration({"format": "old"}, path)
    write_calibration({"format": "new"}, path)
    assert json.loads(path.read_text()) == {"format": "new"}
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]


@pytest.mark.slow
def test_calibrate_under_torchrun_writes_the_policy_file(tmp_path: Path) -> None:
    out = tmp_path / "cache" / "calibration.json"
    cmd = ["-m", "cgx2.bench", "calibrate", "--sizes", "64K,1M", "--iters", "2", "--warmup", "1"]
    # CGX2_CALIBRATION_FILE: the default --out
    proc = _torchrun(cmd, tmp_path, CUDA_VISIBLE_DEVICES="", CGX2_CALIBRATION_FILE=str(out))
    assert proc.returncode == 0, proc.stderr

    data = json.loads(out.read_text())
    assert set(data) == {
        "format",
        "created",
        "torch",
        "device_name",
        "world_size",
        "backend",
        "device_type",
        "crossover_bytes",
        "beside_crossover_bytes",
        "measurements",
        "node_mesh_faster",
    }
    assert data["node_mesh_faster"] == {}  # one node: no mesh to choose
    assert data["format"] == "cgx2-calibration/1"
    created = datetime.datetime.fromisoformat(data["created"])
    assert created.utcoffset() == datetime.timedelta(0)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - created).total_seconds() < 600
    assert data["torch"] == torch.__version__
    assert (data["device_name"], data["device_type"]) == ("cpu", "cpu")
    assert (data["world_size"], data["backend"]) == (2, "gloo")
    measured = [(m["dtype"], m["bytes"]) for m in data["measurements"]]
    assert measured == [("fp32", 64 * K), ("fp32", M), ("bf16", 64 * K), ("bf16", M)]
    for m in data["measurements"]:
        assert set(m) == {"dtype", "bytes", "plain_s", "compressed_s"}
        assert 0 < m["plain_s"] < 60 and 0 < m["compressed_s"] < 60
    fp32, bf16 = data["measurements"][:2], data["measurements"][2:]
    assert data["crossover_bytes"] == {
        "cpu/gloo/fp32": crossover(fp32),
        "cpu/gloo/16bit": crossover(bf16),
    }
    beside = {
        "cpu/gloo/fp32": crossover(fp32, CPU_MARGIN),
        "cpu/gloo/16bit": crossover(bf16, CPU_MARGIN),
    }
    assert data["beside_crossover_bytes"] == beside  # DDP's hooks, beside the backward pass
    assert [p.name for p in out.parent.iterdir()] == ["calibration.json"]

    # Rank 0 alone prints: one table (a row per measurement), its legend, the crossovers.
    lines = proc.stdout.splitlines()
    assert proc.stdout.count("speedup vs gloo") == 2  # the header and its legend line
    header_at = next(i for i, line in enumerate(lines) if "speedup vs gloo" in line)
    assert lines[header_at].split() == "size dtype plain ms cgx2 ms speedup vs gloo".split()
    body = [line.split() for line in lines[header_at + 2 : header_at + 6]]
    assert [row[:2] for row in body] == [
        ["64K", "fp32"],
        ["1M", "fp32"],
        ["64K", "bf16"],
        ["1M", "bf16"],
    ]
    for row, m in zip(body, data["measurements"], strict=True):
        assert float(row[2]) == pytest.approx(1e3 * m["plain_s"], abs=6e-4)
        assert float(row[4]) == pytest.approx(m["plain_s"] / m["compressed_s"], abs=6e-3)

    def said(value: int | None, before: str = "") -> str:
        return "never" if value is None else before + {64 * K: "64K", M: "1M"}[value]

    for key, value in data["crossover_bytes"].items():
        line = f"  {key}: {said(value)}"
        beside = data["beside_crossover_bytes"][key]
        if beside != value:  # the hooks' crossover, where the margin moved it
            line += f", beside a training step (DDP's hooks, CPU tensors) {said(beside, 'from ')}"
        assert line in lines, lines
    assert lines[-1] == f"wrote {out}"


def _calibrate_across_nodes() -> list:
    """calibrate() where the job spans nodes of several ranks (the mesh and its timing stood in
    for): the file records where the node mesh won, and the report says so."""
    from unittest import mock

    from cgx2.bench import calibrate as module

    won = {M: True, 4 * M: False}
    with (
        mock.patch.object(module.policy, "hierarchical", return_value=True),
        mock.patch.object(module, "node_mesh", return_value="mesh"),
        mock.patch.object(module, "mesh_against_flat", return_value=won) as timed,
    ):
        data = module.calibrate([M, 4 * M], ["fp32"], warmup=0, iters=1, device=torch.device("cpu"))
    return [data["node_mesh_faster"], timed.call_args.args[2:], module.format_report(data)]


def test_calibrate_records_where_the_node_mesh_won_across_nodes(dist2) -> None:
    for tables, args, report in dist2.run(_calibrate_across_nodes):
        assert tables == {"cpu/gloo/fp32": {str(M): True, str(4 * M): False}}
        assert args[:3] == ("mesh", 4, 512) and args[-3:] == ([M, 4 * M], 0, 1)
        assert (
            "  cpu/gloo/fp32 across nodes: the node mesh at 1M, the flat allreduce elsewhere"
            in (report.splitlines())
        )


def test_a_new_calibration_keeps_what_the_earlier_file_measured_elsewhere(tmp_path: Path) -> None:
    """Calibrating gloo after NCCL (or fp32 after bf16) leaves the other's crossovers and node
    mesh tables in the file; what both measured takes the new values."""
    from cgx2.bench.calibrate import keep_other_crossovers
    from cgx2.collectives.policy import CALIBRATION_FORMAT

    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {
                "format": CALIBRATION_FORMAT,
                "crossover_bytes": {"cuda/nccl/fp32": 1, "cpu/gloo/fp32": 2},
                "node_mesh_faster": {"cpu/gloo/16bit": {"1048576": True}},
            }
        )
    )
    new = {
        "format": CALIBRATION_FORMAT,
        "crossover_bytes": {"cpu/gloo/fp32": 3},
        "beside_crossover_bytes": {},
        "node_mesh_faster": {"cpu/gloo/fp32": {"1": False}},
    }
    merged = keep_other_crossovers(new, path)
    assert merged["crossover_bytes"] == {"cuda/nccl/fp32": 1, "cpu/gloo/fp32": 3}
    assert merged["node_mesh_faster"] == {
        "cpu/gloo/16bit": {"1048576": True},
        "cpu/gloo/fp32": {"1": False},
    }
    assert keep_other_crossovers(new, tmp_path / "absent.json") == new


def test_the_file_written_is_one_the_policy_reads_and_no_larger(tmp_path: Path) -> None:
    from cgx2.collectives import calibration_file

    data = {"format": calibration_file.FORMAT, "crossover_bytes": {"cpu/gloo/fp32": 8192}}
    path = write_calibration(data, tmp_path / "c.json")
    assert path.stat().st_mode & 0o022 == 0  # only its owner may write it
    assert calibration_file.load(str(path)) == data
    big = {**data, "measurements": [{"bytes": n} for n in range(50_000)]}
    with pytest.raises(ValueError, match="more than the 262144"):
        write_calibration(big, tmp_path / "big.json")
    assert not (tmp_path / "big.json").exists()


@pytest.mark.parametrize("case", ["world-writable", "deep"])
def test_an_earlier_file_the_policy_would_refuse_adds_nothing(
    tmp_path: Path, caplog, case: str
) -> None:
    from cgx2.bench.calibrate import keep_other_crossovers
    from cgx2.collectives.policy import CALIBRATION_FORMAT

    path = tmp_path / "c.json"
    if case == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        path.write_text(
            json.dumps({"format": CALIBRATION_FORMAT, "crossover_bytes": {"cuda/nccl/fp32": 1}})
        )
        path.chmod(0o666)
    new = {"format": CALIBRATION_FORMAT, "crossover_bytes": {"cpu/gloo/fp32": 3}}
    assert keep_other_crossovers(new, path) == new
    assert f"not keeping the crossovers of the calibration file {path}" in caplog.text


def test_calibrate_times_the_node_mesh_on_gpus_across_hosts() -> None:
    """Across hosts of several GPUs (the policy's hierarchical() stood in for), the node mesh is
    timed against the flat allreduce for CUDA tensors on NCCL too, on the GPU, and recorded
    under cuda/nccl keys that the policy reads; one host: nothing timed."""
    from unittest import mock

    from cgx2.bench import calibrate as module

    cuda = torch.device("cuda", 1)
    won = {M: False, 4 * M: True}
    group = object()
    with (
        mock.patch.object(module.policy, "hierarchical", return_value=True) as several,
        mock.patch.object(module, "node_mesh", return_value="mesh") as made,
        mock.patch.object(module, "mesh_against_flat", return_value=won) as timed,
    ):
        tables = module.node_mesh_tables([M, 4 * M], ["fp32", "bf16"], 0, 1, cuda, group, "nccl")
        assert several.call_args.args == (group, module.BITS)
        assert made.call_args.args == ("cuda",)
        assert timed.call_args.args[1:3] == (group, "mesh")
        assert timed.call_args.kwargs == {"device": cuda}
        several.return_value = False
        assert module.node_mesh_tables([M], ["fp32"], 0, 1, cuda, group, "nccl") == {}
    assert tables == {
        "cuda/nccl/fp32": {str(M): False, str(4 * M): True},
        "cuda/nccl/16bit": {str(M): False, str(4 * M): True},
    }
