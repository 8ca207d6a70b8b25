"""``python -m cgx2.env``: each setting's value and source (environment, default, tuned,
calibration file), its JSON, the calibration file's crossovers, the GPUs' peer-to-peer, and that
it runs where Triton and matplotlib cannot be imported."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_bench_cli import _env

from cgx2 import config
from cgx2 import env as cgx2_env

# A finder, first on the path of the subprocess, that refuses these packages as missing ones.
HIDE = """
import sys


class _Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hidden())
"""


def _run(tmp_path: Path, args: list[str], hide: bool = False, **env: str | None):
    env = {"CGX2_CALIBRATION_FILE": str(tmp_path / "absent.json"), **env}
    variables = _env(CUDA_VISIBLE_DEVICES="", **env)
    if hide:
        folder = tmp_path / "hide"
        folder.mkdir(exist_ok=True)
        (folder / "sitecustomize.py").write_text(HIDE)
        variables["PYTHONPATH"] = f"{folder}:{variables['PYTHONPATH']}"
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env=variables
    )


def test_json_says_each_setting_and_where_it_came_from(tmp_path: Path) -> None:
    """A variable set in the environment is reported with its parsed value and "environment";
    one left unset, with its default; one cgx2 does not read, as such."""
    proc = _run(
        tmp_path,
        ["-m", "cgx2.env", "--json"],
        CGX2_CROSSOVER_BYTES="4M",
        CGX_COMPRESSION_BUCKET_SIZE=None,
        CGX2_CROSOVER_BYTES="1",
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    s = found["settings"]
    assert s["CGX2_CROSSOVER_BYTES"] == {"value": 4 << 20, "source": "environment"}
    assert s["CGX_COMPRESSION_BUCKET_SIZE"] == {"value": 512, "source": "default"}
    assert s["CGX2_CROSOVER_BYTES"] == {"value": "1", "source": "environment (not read by cgx2)"}
    (cpu,) = [r for r in found["regimes"] if r["device"] == "cpu"]
    assert cpu["regime"] == "cpu" and cpu["backend"] == "gloo"
    assert cpu["crossover"]["fp32"] == {
        "bytes": 4 << 20,
        "source": "environment: CGX2_CROSSOVER_BYTES",
    }
    assert found["versions"]["torch"] == torch.__version__
    assert "gloo" in found["versions"]["backends"].split(", ")
    assert found["calibration_file"]["status"] == "absent"
    assert found["gpus"]["count"] == 0 and found["gpus"]["why"]


def test_an_invalid_setting_is_reported_not_raised(tmp_path: Path) -> None:
    """A bug report is most needed where a variable is wrong: the report goes on, names it
    first, and gives the error cgx2 would raise."""
    proc = _run(tmp_path, ["-m", "cgx2.env"], CGX2_PIPELINE_BYTES="abc", CGX2_NATIVE="maybe")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[2] == (
        "cgx2 will raise at its first call: invalid CGX2_PIPELINE_BYTES, CGX2_NATIVE (see Settings)"
    )
    text = " ".join(proc.stdout.split())
    assert "CGX2_NATIVE='maybe' is invalid" in text
    assert "CPU codec: on" in text or "NOT built" in text  # the default, where it is invalid


def test_sources_reads_config_tables() -> None:
    environ = {"CGX2_PIPELINE_BYTES": "8M", "CGX_INNER_COMMUNICATOR_TYPE": "nccl"}
    found = config.sources(environ)
    assert found["CGX2_PIPELINE_BYTES"] == (8 << 20, "environment")
    assert found["CGX_INNER_COMMUNICATOR_TYPE"] == ("NCCL", "environment")
    assert found["CGX2_NATIVE"] == (True, "default")
    assert found["CGX_COMPRESSION_MINIMAL_SIZE"] == (16, "default")
    bad = config.sources({"CGX_COMPRESSION_QUANTIZATION_BITS": "9"})
    value, source = bad["CGX_COMPRESSION_QUANTIZATION_BITS"]
    assert value == "9" and source.startswith("environment (invalid:") and "1..8" in source
    # Every field of both sections, once each.
    fields = [f for c in (config.CGXConfig, config.TuningConfig) for f in c.__dataclass_fields__]
    assert len(found) == len(fields)


def test_sources_says_tuned_overrides() -> None:
    with config.tuned(crossover_bytes=0, transport="process_group"):
        found = config.sources()
    assert found["CGX2_CROSSOVER_BYTES"] == (0, "tuned")
    assert found["CGX2_TRANSPORT"] == ("process_group", "tuned")


def test_every_variable_named_is_one_config_reads() -> None:
    """The names :func:`cgx2.config.sources` gives are string literals of cgx2/config.py: the
    variables it reads, not names guessed wrong."""
    tree = ast.parse(Path(config.__file__).read_text())
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    named = set(config.sources({}))
    assert named <= literals, named - literals


def test_calibration_file_crossovers_and_source(tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    data = {
        "format": "cgx2-calibration/1",
        "crossover_bytes": {"cpu/gloo/fp32": 1 << 20, "cpu/gloo/16bit": None},
        "node_mesh_faster": {"cpu/gloo/fp32": {"1048576": True, "65536": False}},
    }
    path.write_text(json.dumps(data))
    path.chmod(0o600)
    proc = _run(tmp_path, ["-m", "cgx2.env", "--json"], CGX2_CALIBRATION_FILE=str(path))
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["calibration_file"]["status"] == "used"
    (cpu,) = [r for r in found["regimes"] if r["device"] == "cpu"]
    assert cpu["crossover"]["fp32"] == {
        "bytes": 1 << 20,
        "source": "calibration file: cpu/gloo/fp32",
    }
    assert cpu["crossover"]["16bit"]["bytes"] is None
    s = found["settings"]
    assert s["CGX2_CROSSOVER_BYTES"]["source"] == "calibration file"
    assert s["CGX2_NODE_MESH"]["source"] == "calibration file"
    text = _run(tmp_path, ["-m", "cgx2.env"], CGX2_CALIBRATION_FILE=str(path)).stdout
    assert "cpu/gloo/fp32: 1 MiB" in text and "cpu/gloo/16bit: never" in text
    assert "node mesh faster at: 1 MiB" in text

    path.chmod(0o622)  # writable by others: not read, and why
    found = json.loads(
        _run(tmp_path, ["-m", "cgx2.env", "--json"], CGX2_CALIBRATION_FILE=str(path)).stdout
    )
    assert found["calibration_file"]["status"] == "ignored"
    assert "writable by users other than its owner" in found["calibration_file"]["why"]


def test_text_runs_without_triton_and_matplotlib(tmp_path: Path) -> None:
    """Where neither can be imported it still reports, says Triton is not installed, and
    imports neither otherwise (checked in a process where they are importable)."""
    proc = _run(tmp_path, ["-m", "cgx2.env"], hide=True)
    assert proc.returncode == 0, proc.stderr
    assert "triton not installed" in proc.stdout
    for heading in ("Versions", "Compiled extension cgx2._C", "GPUs", "Calibration file"):
        assert f"\n{heading}\n" in proc.stdout
    assert "CGX2_CROSSOVER_BYTES" in proc.stdout and "(default)" in proc.stdout
    assert all(len(line) <= 100 for line in proc.stdout.splitlines())
    code = (
        "import sys, cgx2.env; cgx2.env.main([]); "
        "assert not {'triton', 'matplotlib'} & set(sys.modules), sorted(sys.modules)"
    )
    proc = _run(tmp_path, ["-c", code])
    assert proc.returncode == 0, proc.stderr


def test_extension_parts_say_why_not(monkeypatch) -> None:
    """Without the extension every part is off with the reason; with CGX2_NATIVE=0 the codec is
    off by that variable."""
    if cgx2_env.extension.load() is None:
        pytest.skip("cgx2._C is not built here")
    with config.tuned(native_codec=False, transport="process_group"):
        found = cgx2_env.compiled()
    assert found["built"] and not found["cpu_codec"]["on"]
    assert "CGX2_NATIVE=0" in found["cpu_codec"]["why"]
    assert not found["shm"]["on"] and "CGX2_TRANSPORT=process_group" in found["shm"]["why"]
    monkeypatch.setattr(cgx2_env, "_built", lambda: (None, "not built (no compiler)"))
    found = cgx2_env.compiled()
    assert not found["built"]
    assert all(found[k] == {"on": False, "why": "not built (no compiler)"} for k in ("shm", "nccl"))


def test_gpus_report_peer_to_peer(monkeypatch) -> None:
    """Two GPUs, the second unable to reach the first: each pair is listed, and the text names
    the pair without peer-to-peer."""

    class Props:
        name, total_memory, major, minor = "H100", 80 << 30, 9, 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) == (0, 1))
    found = cgx2_env.gpus()
    assert found["count"] == 2 and found["devices"][1]["capability"] == "9.0"
    assert found["peer_to_peer"] == [
        {"from": 0, "to": 1, "peer": True},
        {"from": 1, "to": 0, "peer": False},
    ]
    report = {
        "versions": cgx2_env.versions(),
        "platform": "x",
        "cpus": 1,
        "extension": {"built": False, "path": None, "why": "w"}
        | {k: {"on": False, "why": "w"} for k in ("cpu_codec", "shm", "nccl")},
        "gpus": found,
        "regimes": [],
        "regime_why": "",
        "calibration_file": {"path": "p", "status": "absent", "why": ""},
        "settings": {"CGX2_X": {"value": None, "source": "default"}},
    }
    text = cgx2_env.format_text(report)
    assert "cuda:1 H100, 80 GiB" in text and "peer-to-peer: NOT 1->0" in text


def test_console_script_is_declared() -> None:
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert 'cgx2-env = "cgx2.env:console"' in text
    assert callable(cgx2_env.console)
    assert os.path.basename(cgx2_env.__file__) == "env.py"
