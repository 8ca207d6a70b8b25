"""The routing policy: regime detection from the group's backend, NCCL's variables and the
GPUs' peer access; crossovers per regime and dtype, from CGX2_CROSSOVER_BYTES, a calibration
file (rank 0's copy) or the tables; the plain result below the crossover, in every entry."""

import contextlib
import datetime
import gc
import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
from env_vars import setenv

import cgx2
from cgx2 import comm, config
from cgx2.collectives import CallSettings, crossovers, policy, regimes
from cgx2.collectives.policy import crossover_bytes, detect_regime

CUDA = torch.device("cuda", 0)
MiB = 1 << 20


@pytest.fixture
def clean_env(monkeypatch):
    for var in (
        "NCCL_P2P_DISABLE",
        "NCCL_SHM_DISABLE",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "CGX2_CROSSOVER_BYTES",
        "CGX2_CUDA_GRAPHS",
    ):
        monkeypatch.delenv(var, raising=False)
    policy.reset()
    yield monkeypatch
    monkeypatch.undo()
    policy.reset()


def _regime_is(monkeypatch, where):
    monkeypatch.setattr(regimes, "detect_regime", lambda *args: where)
    policy.reset()


def test_regime_is_read_once_per_device(clean_env):
    """The threshold runs before every allreduce: the regime is detected once, while
    CGX2_CROSSOVER_BYTES stays live."""
    calls = []
    clean_env.setattr(regimes, "detect_regime", lambda *args: calls.append(args) or "shm")
    for _ in range(3):
        assert crossover_bytes(CUDA, torch.float32) == 16 * MiB
    assert len(calls) == 1
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "123")
    assert crossover_bytes(CUDA, torch.float32) == 123
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "1M")
    assert crossover_bytes(CUDA, torch.float32) == MiB


@pytest.mark.parametrize(
    ("env", "peers", "regime"),
    [
        ({}, True, "nvlink"),
        ({}, False, "shm"),
        ({"NCCL_P2P_DISABLE": "1"}, True, "shm"),
        ({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}, True, "socket"),
        ({"NCCL_P2P_DISABLE": "0"}, True, "nvlink"),
        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, True, "socket"),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, True, "nvlink"),
    ],
)
def test_regime_detection(clean_env, env, peers, regime):
    for k, v in env.items():
        clean_env.setenv(k, v)
    clean_env.setattr(regimes, "_peers_reachable", lambda: peers)
    assert detect_regime(CUDA) == regime
    assert detect_regime(torch.device("cpu")) == "cpu"


def test_cuda_tensors_on_gloo_cross_host_sockets(clean_env):
    """CUDA tensors on a group whose CUDA collectives are not NCCL's (gloo: no NCCL, e.g. on
    Windows) go through host memory and TCP, whatever the GPUs reach: the socket regime, so
    they are compressed from its crossover rather than NVLink's."""
    clean_env.setattr(regimes, "_peers_reachable", lambda: True)
    assert detect_regime(CUDA, "nccl", True) == "nvlink"
    assert detect_regime(CUDA, "gloo", False) == "socket"
    assert detect_regime(torch.device("cpu"), "gloo", False) == "cpu"


def test_gloos_collectives_run_on_the_groups_worker_unless_turned_off(clean_env):
    group = dist.ProcessGroup(0, 2)
    comm.group_state(group).info = comm.GroupInfo("gloo", 2, 0, False, False, 1800.0)
    assert policy.runs_on_worker(torch.zeros(4), group)
    with config.tuned(comm_worker=False):
        assert not policy.runs_on_worker(torch.zeros(4), group)


def test_a_launcher_variable_that_is_not_a_count_is_named(clean_env):
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two'"):
        detect_regime(CUDA)


@pytest.mark.parametrize(
    ("regime", "dtype", "expected"),
    [
        ("nvlink", torch.float32, 256 * MiB),
        ("nvlink", torch.bfloat16, None),
        ("nvlink", torch.float16, None),
        ("shm", torch.bfloat16, 16 * MiB),
        ("socket", torch.float32, 4 * MiB),
        ("cpu", torch.float32, 0),
    ],
)
def test_crossover_per_regime_and_dtype(clean_env, regime, dtype, expected):
    _regime_is(clean_env, regime)
    assert crossover_bytes(CUDA, dtype) == expected


@pytest.mark.parametrize(
    ("regime", "dtype", "expected"),
    [
        ("nvlink", torch.float32, 64 * MiB),
        ("nvlink", torch.bfloat16, 256 * MiB),
        ("shm", torch.float32, 4 * MiB),
        ("shm", torch.bfloat16, 16 * MiB),
        ("socket", torch.bfloat16, 4 * MiB),
    ],
)
def test_crossover_with_cuda_graphs(clean_env, regime, dtype, expected):
    """Replaying graphs costs the host less: compression pays from smaller sizes."""
    _regime_is(clean_env, regime)
    with config.tuned(cuda_graphs=True):
        assert crossover_bytes(CUDA, dtype) == expected
    assert crossover_bytes(CUDA, dtype) == policy.CROSSOVER_BYTES[regime][dtype.itemsize < 4]


def test_variable_overrides_and_is_checked(clean_env):
    _regime_is(clean_env, "nvlink")
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "0")
    assert crossover_bytes(CUDA, torch.bfloat16) == 0
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "auto")
    assert crossover_bytes(CUDA, torch.bfloat16) is None
    for bad in ("-1", "1 TB", "lots"):
        clean_env.setenv("CGX2_CROSSOVER_BYTES", bad)
        with pytest.raises(ValueError, match="CGX2_CROSSOVER_BYTES"):
            crossover_bytes(CUDA, torch.float32)
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "7")
    with config.tuned(crossover_bytes=5):  # an explicit override beats the variable
        assert crossover_bytes(CUDA, torch.float32) == 5


def test_a_regime_where_compression_never_won_never_compresses(clean_env):
    _regime_is(clean_env, "nvlink")
    clean_env.setitem(policy.CROSSOVER_BYTES, "nvlink", (256 * MiB, None))
    assert crossover_bytes(CUDA, torch.float16) is None
    assert crossover_bytes(CUDA, torch.float32) == 256 * MiB


def _calibration_file(path, crossovers, fmt=policy.CALIBRATION_FORMAT, beside=None):
    data = {"format": fmt, "crossover_bytes": crossovers}
    if beside is not None:
        data["beside_crossover_bytes"] = beside
    path.write_text(json.dumps(data))
    return str(path)


def test_a_calibration_files_crossovers_beside_the_step_serve_the_hooks(clean_env, tmp_path):
    """Calls on a worker beside the training loop (DDP's hooks) take the file's second
    crossovers; a key without one takes the first."""
    import threading

    from cgx2 import cpu_threads

    _regime_is(clean_env, "nvlink")
    path = _calibration_file(
        tmp_path / "c.json",
        {"cuda/nccl/fp32": 1024, "cuda/nccl/16bit": 8},
        beside={"cuda/nccl/fp32": None},
    )
    seen = []

    def on_worker() -> None:
        cpu_threads.lend(1)
        seen.extend(crossover_bytes(CUDA, dtype) for dtype in (torch.float32, torch.bfloat16))

    with config.tuned(calibration_file=path):
        worker = threading.Thread(target=on_worker)
        worker.start()
        worker.join()
        assert crossover_bytes(CUDA, torch.float32) == 1024
        assert seen == [None, 8]


def test_a_calibration_file_sets_the_crossovers_it_measured(clean_env, tmp_path):
    """Keys are device/backend/width; a key the file lacks keeps the table's value."""
    _regime_is(clean_env, "nvlink")
    path = _calibration_file(tmp_path / "c.json", {"cuda/nccl/16bit": None, "cuda/gloo/fp32": 9})
    with config.tuned(calibration_file=path):
        assert crossover_bytes(CUDA, torch.bfloat16) is None
        assert crossover_bytes(CUDA, torch.float32) == 256 * MiB  # not in the file for nccl
    path = _calibration_file(tmp_path / "d.json", {"cuda/nccl/fp32": 1234})
    with config.tuned(calibration_file=path):
        assert crossover_bytes(CUDA, torch.float32) == 1234
    assert crossover_bytes(CUDA, torch.float32) == 256 * MiB  # another file: tables again


def test_cpu_tensors_across_nodes_take_a_calibration_file_over_measuring(clean_env, tmp_path):
    """A calibration file's crossover is used as it is; without a group (no link to measure)
    the table's."""
    cpu = torch.device("cpu")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    config.reload()
    path = _calibration_file(tmp_path / "c.json", {"cpu/gloo/fp32": None})
    with config.tuned(calibration_file=path):
        assert crossover_bytes(cpu, torch.float32) is None
    with config.tuned(calibration_file=str(tmp_path / "none.json")):
        assert crossover_bytes(cpu, torch.float32) == 0


@contextlib.contextmanager
def _each_rank_a_node():
    """The launcher's variables for a job whose every rank is a node of its own."""
    try:
        with setenv(WORLD_SIZE=str(dist.get_world_size()), LOCAL_WORLD_SIZE="1"):
            config.reload()
            yield
    finally:
        policy.reset()


def _measured_at_first_use(calibration: str) -> list:
    """Each rank a node of its own (LOCAL_WORLD_SIZE 1), CPU tensors, no calibration file."""
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("cgx2").addHandler(handler)
    logging.getLogger("cgx2").setLevel(logging.INFO)
    try:
        with _each_rank_a_node(), config.tuned(calibration_file=calibration):
            group = dist.new_group()
            x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(dist.get_rank()))
            got = cgx2.quantized_allreduce(x, 4, group=group, seed=3)
            found = policy.crossover_bytes(torch.device("cpu"), torch.float32, group)
            again = cgx2.quantized_allreduce(x, 4, group=group, seed=3)
            dist.destroy_process_group(group)
    finally:
        logging.getLogger("cgx2").removeHandler(handler)
    measured = [m for m in said if "measured on this job's link (group" in m]
    return [found, len(measured), got, torch.equal(got, again)]


def test_cpu_tensors_across_nodes_measure_where_compression_pays_once(dist2, tmp_path):
    """The first compressible call measures plain against quantized on the group itself; every
    rank routes by the slowest rank's times, and never measures again."""
    r0, r1 = dist2.run(_measured_at_first_use, str(tmp_path / "none.json"))
    assert r0[0] == r1[0] and r0[0] in (None, 1 << 20, 4 << 20, 16 << 20)
    assert r0[1] == r1[1] == 1
    assert torch.equal(r0[2], r1[2]) and r0[3] and r1[3]
    path = _calibration_file(tmp_path / "c.json", {"cpu/gloo/fp32": 8192})
    r0, r1 = dist2.run(_measured_at_first_use, path)
    assert r0[:2] == r1[:2] == [8192, 0]  # a file spares the measurement


def _cgx_backend_measures_at_first_use(calibration: str) -> list:
    """As :func:`_measured_at_first_use`, on a ``cgx`` group whose allreduce quantizes: the
    measurement's plain calls are its exact ones, and every rank routes alike."""
    from unittest import mock

    from cgx2.comm import process_group

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("cgx2").addHandler(handler)
    logging.getLogger("cgx2").setLevel(logging.INFO)
    exact = mock.patch.object(
        process_group, "allreduce_plain_", wraps=process_group.allreduce_plain_
    )
    try:
        with (
            _each_rank_a_node(),
            config.tuned(calibration_file=calibration),
            exact as plain,
            setenv(CGX_COMPRESSION_QUANTIZATION_BITS="4"),
        ):
            group = dist.new_group(backend="cgx")
            x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(dist.get_rank()))
            dist.all_reduce(x, group=group)
            dist.all_reduce(torch.randn(1 << 20), group=group)
            dist.destroy_process_group(group)
    finally:
        logging.getLogger("cgx2").removeHandler(handler)
    measured = [m for m in said if "measured on this job's link (group" in m]
    return [len(measured), plain.call_count > 0, x]


def test_the_cgx_backend_across_nodes_measures_where_compression_pays_once(dist2, tmp_path):
    r0, r1 = dist2.run(_cgx_backend_measures_at_first_use, str(tmp_path / "none.json"))
    assert r0[:2] == r1[:2] == [1, True]
    assert torch.equal(r0[2], r1[2])


def _beside_the_training_step() -> list:
    """Crossovers measured at first use (stood in for): 1 MiB alone, never beside the step."""
    import threading
    from unittest import mock

    from cgx2 import cpu_threads
    from cgx2.collectives import measure

    x = torch.zeros(1 << 20)  # 4 MiB
    seen = []
    with (
        _each_rank_a_node(),
        mock.patch.object(measure, "crossover_on_link", return_value=(1 << 20, None)),
    ):
        group = dist.new_group()
        seen.append(policy.route(x, group, 4, 512).compress)

        def on_worker() -> None:
            cpu_threads.lend(torch.get_num_threads())
            seen.append(policy.route(x, group, 4, 512).compress)
            seen.append(policy.crossover_bytes(x.device, x.dtype, group))
            with config.tuned(crossover_bytes=0):
                seen.append(policy.route(x, group, 4, 512).piece_numel)

        worker = threading.Thread(target=on_worker)
        worker.start()
        worker.join()
        seen.append(policy.crossover_bytes(x.device, x.dtype, group))
        with config.tuned(crossover_bytes=0):
            seen.append(policy.route(x, group, 4, 512).piece_numel)
        dist.destroy_process_group(group)
    return seen


def test_calls_beside_the_training_step_take_the_crossover_with_the_cpu_margin(dist2):
    """DDP's hooks reduce on a worker beside the backward pass, whose computation takes the
    cores the codec needs: there the crossover measured with the margin holds, and one piece
    a bucket (smaller pieces only for calls alone)."""
    one_piece = policy.PIECE_NUMEL["cpu"] // 1024 * 1024
    for seen in dist2.run(_beside_the_training_step):
        assert seen == [True, False, None, one_piece, 1 << 20, policy.CPU_ACROSS_NODES_PIECE_NUMEL]


def _measured_under_tuned_blocks() -> list:
    """Routes decided in and out of ``config.tuned`` blocks, counting the measurements."""
    from unittest import mock

    from cgx2.collectives import measure

    x = torch.zeros(1 << 20)
    checks = []
    with (
        _each_rank_a_node(),
        mock.patch.object(measure, "crossover_on_link", return_value=(1 << 20, 1 << 20)) as m,
    ):
        group = dist.new_group()
        checks.append(policy.route(x, group, 4, 512).check)
        with config.tuned(check_agreement="off", comm_worker=False, crossover_bytes=0):
            checks.append(policy.route(x, group, 4, 512).check)
        checks.append(policy.route(x, group, 4, 512).check)
        kept = m.call_count
        with config.tuned(pipeline_bytes=1 << 20):  # changes what the measurement timed
            policy.route(x, group, 4, 512)
        dist.destroy_process_group(group)
    return [checks, kept, m.call_count]


def test_settings_that_change_no_measurement_keep_the_measured_crossovers(dist2):
    """A ``tuned`` block of the check, the worker or the crossover decides the routes anew but
    keeps the crossovers measured on the link (seconds each); one of the pipeline measures
    again."""
    for checks, kept, measured in dist2.run(_measured_under_tuned_blocks):
        assert checks == ["now", "", "now"]
        assert (kept, measured) == (1, 2)


@pytest.mark.parametrize(
    "content",
    [
        '{"format": "cgx2-calibration/1", "crossover_bytes": {"cuda/nccl/fp32": -4}}',
        '{"format": "other/1", "crossover_bytes": {}}',
        '{"format": "cgx2-calibration/1", "crossover_bytes": {}, "beside_crossover_bytes": 3}',
        '{"format": "cgx2-calibration/1", "crossover_bytes": {},'
        ' "node_mesh_faster": {"cpu/gloo/fp32": {"1M": true}}}',
        "[1, 2]",
        "not json",
    ],
)
def test_an_unusable_calibration_file_is_ignored_with_a_warning(
    clean_env, tmp_path, caplog, content
):
    _regime_is(clean_env, "shm")
    path = tmp_path / "c.json"
    path.write_text(content)
    with config.tuned(calibration_file=str(path)):
        assert crossover_bytes(CUDA, torch.float32) == 16 * MiB
    assert "ignoring the calibration file" in caplog.text


def _route_with_own_calibration(directory: str) -> list[object]:
    """Each rank names its own calibration file; rank 0's says compress from 8 KiB, rank 1's
    from 1 GiB. Both must route by rank 0's."""
    rank = dist.get_rank()
    path = os.path.join(directory, f"rank{rank}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "format": policy.CALIBRATION_FORMAT,
                "crossover_bytes": {"cpu/gloo/fp32": 8192 if rank == 0 else 1 << 30},
            },
            f,
        )
    with config.tuned(calibration_file=path):
        group = dist.new_group()
        found = policy.crossover_bytes(torch.device("cpu"), torch.float32, group)
        x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
        exact = x.clone()
        dist.all_reduce(exact, group=group)
        got = cgx2.quantized_allreduce(x, 4, group=group, seed=3)
        dist.destroy_process_group(group)
    return [found, torch.equal(got, exact)]


def test_ranks_route_by_rank_0s_calibration(dist2, tmp_path):
    assert dist2.run(_route_with_own_calibration, str(tmp_path)) == [[8192, False]] * 2


_BAD_CALIBRATIONS = {
    # What rank 0's file is, and what every rank's warning must say of it.
    "oversize": "larger than the 262144 a calibration file takes",
    "deep": "nests deeper than 8 levels",
    "not json": "is not JSON of a calibration file",
    "schema": "not a size in bytes",
    "world-writable": "is writable by users other than its owner (mode 666)",
    "group-writable": "is writable by users other than its owner (mode 664)",
    "another owner": "is owned by user id 65534",
    "fifo": "is not a regular file",
    "directory": "is not a regular file",
}


def _write_bad_calibration(case: str, path: str) -> None:
    good = {"format": policy.CALIBRATION_FORMAT, "crossover_bytes": {"cpu/gloo/fp32": 8192}}
    if case == "fifo":
        os.mkfifo(path, 0o600)
    elif case == "directory":
        os.mkdir(path)
    else:
        with open(path, "w") as f:
            if case == "oversize":  # the right format, past the store's 8 MiB values
                json.dump({**good, "measurements": [{"bytes": n} for n in range(600_000)]}, f)
            elif case == "deep":
                f.write("[" * 100_000 + "]" * 100_000)
            elif case == "not json":
                f.write('{"format": "cgx2-calibration/1", "crossover_bytes": {')
            elif case == "schema":
                json.dump({**good, "crossover_bytes": {"cpu/gloo/fp32": "8 KiB"}}, f)
            else:
                json.dump(good, f)
        mode = {"world-writable": 0o666, "group-writable": 0o664}.get(case, 0o644)
        os.chmod(path, mode)
        if case == "another owner":
            os.chown(path, 65534, 65534)


def _bad_calibration(case: str, directory: str) -> dict:
    """Rank 0's calibration file is unusable as ``case`` says; rank 1's own is good (and says
    compress from 1 GiB). Every rank must log the same warning, naming rank 0's file and the
    reason, and route by the built-in tables: no hang, no error."""
    rank = dist.get_rank()
    path = os.path.join(directory, f"{case.replace(' ', '-')}-{rank}.json")
    if rank == 0:
        _write_bad_calibration(case, path)
    else:
        with open(path, "w") as f:
            json.dump(
                {
                    "format": policy.CALIBRATION_FORMAT,
                    "crossover_bytes": {"cpu/gloo/fp32": 1 << 30},
                },
                f,
            )
    dist.barrier()
    warned: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("cgx2").addHandler(handler)
    try:
        with config.tuned(calibration_file=path):
            group = dist.new_group()
            found = policy.calibration(group)
            dist.destroy_process_group(group)
    finally:
        logging.getLogger("cgx2").removeHandler(handler)
    return {"found": found, "warned": warned}


@pytest.mark.parametrize("case", sorted(_BAD_CALIBRATIONS))
def test_an_unusable_calibration_file_gives_every_rank_the_same_warning(dist2, tmp_path, case):
    """A file larger than the store's values, nested too deep, not JSON, of the wrong schema,
    writable by others, of another user, a FIFO or a directory: every rank warns alike, naming
    rank 0's file and why, and routes by the built-in crossovers."""
    if case == "another owner" and os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    tmp_path.chmod(0o755)
    results = dist2.run(_bad_calibration, case, str(tmp_path))
    name = case.replace(" ", "-")
    for r in results:
        assert r["found"] == {}
        assert len(r["warned"]) == 1, r["warned"]
        assert str(tmp_path / f"{name}-0.json") in r["warned"][0]
        assert _BAD_CALIBRATIONS[case] in r["warned"][0], r["warned"][0]
    assert results[0]["warned"][0] == results[1]["warned"][0]


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"format": "cgx2-calibration/1", "crossover_bytes": {"cpu/gloo/fp32": NaN}}', "NaN"),
        (
            b'{"format": "cgx2-calibration/1", "crossover_bytes": {}, "crossover_bytes": {}}',
            "names a key twice",
        ),
        (
            b'{"format": "cgx2-calibration/1", "crossover_bytes": {"cpu/gloo/fp32": 1'
            + b"0" * 30
            + b"}}",
            "too large",
        ),
        (b"\xff\xfe", "not UTF-8"),
        (b'{"format": "cgx2-calibration/1", "crossover_bytes": {"fp32": 1}}', "device/backend"),
        (
            b'{"format": "cgx2-calibration/1", "crossover_bytes": {},'
            b' "node_mesh_faster": {"cpu/gloo/fp32": {"1M": true}}}',
            "other than sizes",
        ),
        (b'{"format": "cgx2-calibration/1"}', "no 'crossover_bytes'"),
        (b"[1, 2]", "a JSON list, not an object"),
        (b'{"a": ' * 9 + b"1" + b"}" * 9, "nests deeper than 8"),
    ],
)
def test_the_calibration_file_is_parsed_with_bounds_and_its_schema_checked(
    tmp_path, content, reason
):
    from cgx2.collectives import calibration_file

    path = tmp_path / "c.json"
    path.write_bytes(content)
    path.chmod(0o644)
    with pytest.raises(calibration_file.CalibrationFileError, match=reason):
        calibration_file.load(str(path))
    assert calibration_file.load(str(tmp_path / "absent.json")) is None
    nested = {
        "format": policy.CALIBRATION_FORMAT,
        "crossover_bytes": {"cpu/gloo/fp32": None},
        "measurements": [{"a": [[1]]}],
    }
    path.write_text(json.dumps(nested))
    assert calibration_file.load(str(path)) == nested


def _node_mesh_from_rank_0s_calibration(directory: str) -> list[object]:
    """Rank 0's file says the node mesh won at 1 MiB and lost at 16 MiB (rank 1's the
    opposite); timing them at first use would fail."""
    from unittest import mock

    from cgx2.collectives import measure

    rank = dist.get_rank()
    path = os.path.join(directory, f"mesh{rank}.json")
    won = {str(1 << 20): rank == 0, str(16 << 20): rank != 0}
    with open(path, "w") as f:
        json.dump(
            {
                "format": policy.CALIBRATION_FORMAT,
                "crossover_bytes": {},
                "node_mesh_faster": {"cpu/gloo/fp32": won},
            },
            f,
        )
    timing = mock.patch.object(measure, "mesh_against_flat", side_effect=AssertionError("timed"))
    with config.tuned(calibration_file=path), timing:
        group = dist.new_group()
        chosen = [
            policy.by_node_mesh(torch.zeros(n), group, None, CallSettings(4, 512), False)
            for n in (1 << 17, 1 << 18, 1 << 22, 1 << 24)
        ]
        dist.destroy_process_group(group)
    return chosen


def test_the_node_mesh_is_chosen_by_rank_0s_calibration_file_without_timing(dist2, tmp_path):
    """A calibration file that timed the node mesh spares the timing at first use; each call
    goes the way that won nearest its size."""
    assert (
        dist2.run(_node_mesh_from_rank_0s_calibration, str(tmp_path))
        == [[True, True, False, False]] * 2
    )


def _below_and_above_crossover() -> list[bool]:
    """With the crossover at 16 KiB: 4095 fp32 values go plain (exact), 4096 are quantized."""
    os.environ["CGX2_CROSSOVER_BYTES"] = "16K"
    cgx2.config.refresh()  # cgx2 reads the variables once
    try:
        out = []
        for n in (4095, 4096):
            x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
            exact = x.clone()
            dist.all_reduce(exact)
            out.append(torch.equal(cgx2.quantized_allreduce(x, 4, seed=1), exact))
            op = torch.ops.cgx.quantized_allreduce(x, 4, 512, "", "sum", 1, False)
            out.append(torch.equal(op, exact))
        return out
    finally:
        del os.environ["CGX2_CROSSOVER_BYTES"]
        cgx2.config.refresh()


def test_below_the_crossover_the_result_is_the_plain_allreduce(dist2):
    assert dist2.run(_below_and_above_crossover) == [[True, True, False, False]] * 2


def _hook_and_backend_below_the_crossover() -> list[bool]:
    """With a crossover larger than anything here, the hook and the backend send exactly."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cgx2.ddp import CGXState, cgx_hook

    os.environ.update(CGX2_CROSSOVER_BYTES=str(1 << 30), CGX_COMPRESSION_QUANTIZATION_BITS="4")
    cgx2.config.refresh()  # cgx2 reads the variables once
    try:
        group = dist.new_group(backend="cgx")
        x = torch.randn(100_000, generator=torch.Generator().manual_seed(dist.get_rank()))
        exact, got = x.clone(), x.clone()
        dist.all_reduce(exact)
        dist.all_reduce(got, group=group)
        checks = [torch.equal(got, exact), group.bytes_sent == group.bytes_uncompressed]
        model = DDP(torch.nn.Linear(256, 256))
        state = CGXState(None, 1024, {"bits": 4})
        model.register_comm_hook(state, cgx_hook)
        model(torch.randn(8, 256)).sum().backward()
        checks.append(state.bytes_sent == state.bytes_uncompressed > 0)
        dist.destroy_process_group(group)
        return checks
    finally:
        del os.environ["CGX2_CROSSOVER_BYTES"], os.environ["CGX_COMPRESSION_QUANTIZATION_BITS"]
        cgx2.config.refresh()


def test_hook_and_backend_fall_back_in_place(dist2):
    assert dist2.run(_hook_and_backend_below_the_crossover) == [[True, True, True]] * 2


def test_fallback_calls_the_group_synchronously_and_accepts_no_work(monkeypatch):
    """Below the crossover the process group's allreduce runs as ``dist.all_reduce`` runs it
    (``asyncOp`` False, where torch has the field); NCCL then returns no Work object."""
    calls = []

    class Group:
        def allreduce(self, tensors, options):
            calls.append(options)
            tensors[0].add_(1)
            return None

    info = comm.GroupInfo("nccl", 2, 0, True, False, 1800.0)
    monkeypatch.setattr(comm.process_group, "group_info", lambda group: info)
    t = torch.zeros(4)
    assert comm.allreduce_plain_(t, Group(), "sum") is t
    assert torch.equal(t, torch.ones(4))
    assert calls[0].reduceOp == dist.ReduceOp.SUM
    assert getattr(calls[0], "asyncOp", False) is False


@pytest.mark.parametrize("cuda_on_nccl", [True, False])
def test_group_info_is_looked_up_once_per_group_and_dropped_with_it(monkeypatch, cuda_on_nccl):
    """A cgx group's plain allreduce is its own exact one; whether NCCL carries its CUDA
    tensors decides its regime and whether CUDA graphs may replay on it."""
    backends, sizes = [], []
    monkeypatch.setattr(
        comm.process_group.dist, "get_backend", lambda group: backends.append(group) or "cgx"
    )

    class CGXGroup(dist.ProcessGroup):
        def size(self):
            sizes.append(1)
            return 3

        def rank(self):
            return 2

        def allreduce_exact(self, tensor, reduce_op):
            raise AssertionError("not called here")

    group = CGXGroup(2, 3)
    group.cuda_on_nccl = cuda_on_nccl
    info = comm.group_info(group)
    assert comm.group_info(group) is info and len(backends) == len(sizes) == 1
    assert (info.backend, info.size, info.rank) == ("cgx", 3, 2)
    assert info.has_exact_allreduce and info.cuda_on_nccl is cuda_on_nccl
    assert comm.group_size_and_rank(group) == (3, 2)
    state = comm.group_state(group)
    assert state.info is info
    del group, info, backends[:]
    gc.collect()
    assert all(other is not state for other in comm.groups.states())


def test_the_route_names_everything_a_call_needs(clean_env):
    """One decision a call: compress or plain, pieces, the pair all-gather, graphs."""

    class Group(dist.ProcessGroup):
        pass

    group = Group(0, 2)
    clean_env.setattr(comm.process_group.dist, "get_backend", lambda group: "gloo")
    x = torch.zeros(1 << 12)
    route = policy.route(x, group, 4, 512)
    assert route.compress and route.regime == "cpu" and route.pair_gather
    assert not route.graphs and not route.gather_in_place
    assert route.piece_numel == policy.PIECE_NUMEL["cpu"]
    assert not policy.route(x, group, 32, 512).compress  # bits 32: plain, exactly
    assert not policy.route(x[:0], group, 4, 512).compress  # nothing to send
    with config.tuned(crossover_bytes=1 << 20):
        assert not policy.route(x, group, 4, 512).compress
        assert policy.route(x, group, 4, 512, numel=1 << 18).compress


def test_hierarchical_only_for_the_whole_world_of_several_nodes(clean_env):
    class Group(dist.ProcessGroup):
        pass

    world, node = Group(0, 8), Group(0, 4)
    assert not policy.hierarchical(world, 4)  # no launcher variables: one node
    clean_env.setenv("WORLD_SIZE", "8")
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    assert policy.hierarchical(world, 4)
    assert not policy.hierarchical(world, 32)  # nothing to quantize
    assert not policy.hierarchical(node, 4)  # a group inside one node
    with config.tuned(node_mesh=False):  # CGX2_NODE_MESH=0: never
        assert not policy.hierarchical(world, 4)
    clean_env.setenv("LOCAL_WORLD_SIZE", "8")
    assert not policy.hierarchical(world, 4)
    clean_env.setenv("LOCAL_WORLD_SIZE", "1")  # one rank a node: the flat allreduce is inter
    assert not policy.hierarchical(world, 4)


def test_the_node_mesh_carries_calls_whose_nearest_measured_size_it_won(clean_env, monkeypatch):
    """CPU tensors go over the mesh where timing at first use found it faster at the measured
    size nearest (in ratio) the call's; timed once per group and settings; CGX2_NODE_MESH
    overrides; CUDA tensors that NCCL does not carry take the mesh untimed."""

    class Group(dist.ProcessGroup):
        pass

    group = Group(0, 4)
    monkeypatch.setattr(policy, "group_info", lambda g: None)
    monkeypatch.setattr(regimes, "carrier", lambda device, info: ("gloo", False, "cpu"))
    timings = []

    def timed(t, g, mesh, settings, intra_broadcast):
        timings.append((t.dtype, g, mesh, settings.bits, settings.bucket_size, intra_broadcast))
        return {1 * MiB: True, 4 * MiB: False, 16 * MiB: True}

    monkeypatch.setattr(crossovers, "time_mesh", timed)
    x = torch.zeros(1)

    def over(nbytes: int, bits: int = 4) -> bool:
        return policy.by_node_mesh(x, group, "mesh", CallSettings(bits, 512), False, nbytes // 4)

    assert over(256 << 10) and over(0)  # below the smallest size: its answer
    assert over(1 * MiB) and over(int(1.9 * MiB))
    assert not over(int(2.1 * MiB)) and not over(4 * MiB) and not over(7 * MiB)
    assert over(9 * MiB) and over(1 << 30)  # above the largest: its answer
    assert timings == [(torch.float32, group, "mesh", 4, 512, False)]  # once
    assert not over(4 * MiB, bits=2)
    assert len(timings) == 2  # other settings: timed anew
    with config.tuned(node_mesh=False):
        assert not over(1 * MiB)
    with config.tuned(node_mesh=True):
        assert over(4 * MiB)
    monkeypatch.setattr(regimes, "carrier", lambda device, info: ("gloo", False, "socket"))
    cuda = _stand_in_cuda_tensor()  # CUDA tensors through the host (gloo): the mesh, untimed
    assert policy.by_node_mesh(cuda, group, "mesh", CallSettings(4, 512), False, MiB)
    assert len(timings) == 2


def test_a_rank_waiting_for_rank_0s_calibration_fails_clearly(monkeypatch):
    """Rank 0 never routes (its ranks disagree on the arguments): the others raise, naming
    the likely cause, when the store's wait runs out, instead of hanging."""

    class Store:
        timeout = datetime.timedelta(milliseconds=10)

        def check(self, keys):
            return False

    class Group:
        group_name = "7"

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: Store())
    policy.reset()
    with pytest.raises(RuntimeError, match="rank 0 of group '7' did not publish"):
        policy.calibration(Group())


def test_a_cgx_group_uses_its_carriers_calibration(clean_env, tmp_path):
    """A calibration of gloo (or NCCL) serves the cgx backend, whose collectives ride them,
    unless the file has the cgx backend's own."""

    class Group(dist.ProcessGroup):
        pass

    group = Group(0, 2)
    clean_env.setattr(comm.process_group.dist, "get_backend", lambda group: "cgx")
    cpu = torch.device("cpu")
    path = _calibration_file(tmp_path / "c.json", {"cpu/gloo/fp32": 4096})
    with config.tuned(calibration_file=path):
        assert crossover_bytes(cpu, torch.float32, group) == 4096
    path = _calibration_file(tmp_path / "d.json", {"cpu/gloo/fp32": 4096, "cpu/cgx/fp32": 64})
    with config.tuned(calibration_file=path):
        assert crossover_bytes(cpu, torch.float32, group) == 64


@pytest.mark.parametrize(
    ("ms_at_16_mib", "measured", "expected"),
    [
        ((10.0, 8.0), [1, 4, 16, 64], (16 << 20, 64 << 20)),  # won at 16 MiB, not by the margin
        ((10.0, 5.0), [1, 4, 16], (16 << 20, 16 << 20)),  # won by the margin: 64 MiB not timed
        ((10.0, 12.0), [1, 4, 16, 64], (64 << 20, 64 << 20)),  # won only at 64 MiB
    ],
)
def test_first_use_measures_64_mib_where_16_did_not_win(ms_at_16_mib, measured, expected):
    """On a fast link compression may win only past the sizes measured first: a larger one is
    timed where the largest did not win by the CPU margin, instead of never compressing."""
    from unittest import mock

    from cgx2.collectives import measure

    times = {1: (1.0, 2.0), 4: (4.0, 6.0), 16: ms_at_16_mib, 64: (40.0, 20.0)}
    timed = []

    def timed_in_turn(fns, warmup, iters, device, control):
        del fns, warmup, iters, device, control
        timed.append([1, 4, 16, 64][len(timed)])
        return [t / 1e3 for t in times[timed[-1]]]

    group = mock.Mock(group_name="g")
    with mock.patch.object(measure, "timed_in_turn", timed_in_turn):
        assert measure.crossover_on_link(torch.float32, group) == expected
    assert timed == measured


# NCCL across hosts: CUDA tensors' crossovers and the node mesh measured on the job's link, on
# stand-ins (a process group the policy takes for NCCL's, a CUDA device that no tensor is on).


@contextlib.contextmanager
def _nccl_group(size: int = 4, backend: str = "nccl", cuda_on_nccl: bool = True):
    """A process group that the policy takes for one whose CUDA tensors NCCL carries."""

    class Group(dist.ProcessGroup):
        group_name = "stand-in"

    group = Group(0, size)
    comm.group_state(group).info = comm.GroupInfo(
        backend, size, 0, cuda_on_nccl, backend == "cgx", 1800.0
    )
    yield group


def _hosts(monkeypatch, world: int, local: int, tmp_path) -> None:
    """The launcher's variables for ``world`` ranks, ``local`` a host; no calibration file."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setenv("CGX2_CALIBRATION_FILE", str(tmp_path / "none.json"))
    monkeypatch.setattr(regimes, "_peers_reachable", lambda: True)
    policy.reset()


def _measuring(monkeypatch, crossovers=(256 << 10, 256 << 10)) -> list:
    """Stand in for the measurement on the link: it returns ``crossovers``; the calls made."""
    from cgx2.collectives import measure

    calls = []

    def measured(dtype, group, sizes=None, warmup=1, iters=3, larger=None, device=None):
        calls.append((dtype, group, device))
        return crossovers

    monkeypatch.setattr(measure, "crossover_on_link", measured)
    return calls


def test_nccl_across_hosts_measures_the_crossover_once_at_first_use(clean_env, tmp_path):
    """CUDA tensors on NCCL, the launcher saying several hosts: the loopback table (4 MiB)
    does not serve; the crossover is measured on the group's link at its first compressible
    call, once per group and dtype, and taken; a cgx group over NCCL measures alike."""
    _hosts(clean_env, 4, 2, tmp_path)
    calls = _measuring(clean_env)
    with _nccl_group() as group:
        for _ in range(3):
            assert crossover_bytes(CUDA, torch.float32, group) == 256 << 10
        assert crossover_bytes(CUDA, torch.bfloat16, group) == 256 << 10
        assert calls == [(torch.float32, group, CUDA), (torch.bfloat16, group, CUDA)]
        assert crossover_bytes(CUDA, torch.float32) == 4 * MiB  # no group, no link: the table
        with clean_env.context() as patch:  # "cuda" is the current GPU: measured already
            patch.setattr(torch.cuda, "is_available", lambda: True)
            patch.setattr(torch.cuda, "current_device", lambda: 0)
            patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
            assert crossover_bytes(torch.device("cuda"), torch.float32, group) == 256 << 10
        assert len(calls) == 2
    with _nccl_group(backend="cgx") as group:
        assert crossover_bytes(CUDA, torch.float32, group) == 256 << 10
        assert len(calls) == 3
    with _nccl_group(backend="gloo", cuda_on_nccl=False) as group:  # CUDA tensors via the host
        assert crossover_bytes(CUDA, torch.float32, group) == 4 * MiB
        assert len(calls) == 3
    clean_env.setenv("CGX2_CROSSOVER_BYTES", "1M")  # set by hand: nothing measured
    with _nccl_group() as group:
        assert crossover_bytes(CUDA, torch.float32, group) == MiB
    assert len(calls) == 3


@pytest.mark.parametrize(
    ("world", "local", "ranks", "expected"),
    [
        (4, 4, None, 256 * MiB),  # one host: NVLink's table
        (2, 2, None, 256 * MiB),
        (4, 2, [0, 1], 4 * MiB),  # a group inside host 0 of a job across hosts
        (4, 2, [2, 3], 4 * MiB),
    ],
)
def test_nccl_inside_one_host_keeps_the_tables(clean_env, tmp_path, world, local, ranks, expected):
    _hosts(clean_env, world, local, tmp_path)
    calls = _measuring(clean_env)
    clean_env.setattr(regimes, "_global_ranks", lambda group: ranks)
    with _nccl_group(len(ranks or range(world))) as group:
        assert crossover_bytes(CUDA, torch.float32, group) == expected
        assert not policy.spans_hosts(group)
    assert calls == []
    clean_env.setattr(regimes, "_global_ranks", lambda group: [1, 2])  # across hosts 0 and 1
    if local < world:
        with _nccl_group(2) as group:
            assert crossover_bytes(CUDA, torch.float32, group) == 256 << 10
        assert len(calls) == 1


def test_the_calibration_files_cuda_entries_win_over_measuring(clean_env, tmp_path):
    """``python -m cgx2.bench calibrate`` run across the hosts wrote cuda/nccl crossovers:
    they serve; a width the file lacks is measured."""
    _hosts(clean_env, 4, 2, tmp_path)
    calls = _measuring(clean_env)
    path = _calibration_file(
        tmp_path / "c.json", {"cuda/nccl/fp32": 12345}, beside={"cuda/nccl/fp32": 23456}
    )
    with config.tuned(calibration_file=path), _nccl_group() as group:
        assert crossover_bytes(CUDA, torch.float32, group) == 12345
        assert calls == []
        assert crossover_bytes(CUDA, torch.bfloat16, group) == 256 << 10
        assert len(calls) == 1
    with config.tuned(calibration_file=path), _nccl_group(backend="cgx") as group:
        assert crossover_bytes(CUDA, torch.float32, group) == 12345  # its carrier's entry
        assert len(calls) == 1


def test_nothing_is_measured_inside_a_trace_or_a_capture(clean_env, tmp_path, caplog):
    """Traced (torch.compile) or captured into a CUDA graph, a first call takes the table's
    crossover and says so; the first eager call measures, once."""
    _hosts(clean_env, 4, 2, tmp_path)
    calls = _measuring(clean_env)
    caplog.set_level(logging.INFO, logger="cgx2")
    with _nccl_group() as group:
        with clean_env.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            assert crossover_bytes(CUDA, torch.float32, group) == 4 * MiB
        with clean_env.context() as patch:
            patch.setattr(torch.cuda, "is_available", lambda: True)
            patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
            assert crossover_bytes(CUDA, torch.float32, group) == 4 * MiB
        assert calls == []
        assert caplog.text.count("inside a trace or a CUDA graph's capture") == 2
        assert crossover_bytes(CUDA, torch.float32, group) == 256 << 10
        assert crossover_bytes(CUDA, torch.float32, group) == 256 << 10
        assert len(calls) == 1


def _stand_in_cuda_tensor(numel: int = 1):
    """What the policy reads of a CUDA tensor of ``numel`` fp32 values."""
    import types

    return types.SimpleNamespace(
        device=CUDA, dtype=torch.float32, numel=lambda: numel, element_size=lambda: 4
    )


def test_the_node_mesh_on_gpus_is_chosen_against_the_flat_allreduce_by_timing(clean_env, tmp_path):
    """CUDA tensors on NCCL across hosts of several GPUs: the mesh (NVLink inside a host,
    quantized between) carries the sizes where it was timed faster, once per group and
    settings; the calibration file's cuda table spares the timing; inside a trace the mesh,
    untimed; CGX2_NODE_MESH forces; CUDA tensors on gloo take the mesh untimed."""
    _hosts(clean_env, 4, 2, tmp_path)
    timings = []

    def timed(t, group, mesh, settings, intra_broadcast):
        timings.append((t.dtype, mesh, settings.bits, t.device))
        return {1 * MiB: False, 4 * MiB: True, 16 * MiB: True}

    clean_env.setattr(crossovers, "time_mesh", timed)

    def over(group, nbytes: int) -> bool:
        return policy.by_node_mesh(
            _stand_in_cuda_tensor(), group, "mesh", CallSettings(4, 512), False, nbytes // 4
        )

    with _nccl_group() as group:
        with clean_env.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            assert over(group, MiB)  # untimed in a trace: the mesh
        assert timings == []
        assert not over(group, MiB) and not over(group, 256 << 10)
        assert over(group, 4 * MiB) and over(group, 1 << 30)
        assert timings == [(torch.float32, "mesh", 4, CUDA)]
        with config.tuned(node_mesh=True):
            assert over(group, MiB)
        with config.tuned(node_mesh=False):
            assert not over(group, 16 * MiB)
    path = tmp_path / "mesh.json"
    won = {"cuda/nccl/fp32": {str(MiB): True, str(16 * MiB): False}}
    path.write_text(
        json.dumps(
            {"format": policy.CALIBRATION_FORMAT, "crossover_bytes": {}, "node_mesh_faster": won}
        )
    )
    with config.tuned(calibration_file=str(path)), _nccl_group(backend="cgx") as group:
        assert over(group, MiB) and not over(group, 16 * MiB)
    with _nccl_group(backend="gloo", cuda_on_nccl=False) as group:
        assert over(group, MiB)
    assert len(timings) == 1


def _nccl_across_hosts_agrees(rank_ms: dict) -> list:
    """Each rank a host; the policy takes this gloo group for NCCL's and CUDA tensors for the
    CPU's; the plain and quantized calls stand in, each rank timing them as ``rank_ms`` says
    (a clock of their own): the real measurement of the policy, its barriers and the slowest
    rank's times, decides."""
    import types
    from unittest import mock

    from cgx2.collectives import measure

    rank = dist.get_rank()
    clock = [0.0]
    stopwatch = types.SimpleNamespace(perf_counter=lambda: clock[0])
    seen = []

    def plain(buf, group, op):
        clock[0] += rank_ms[rank][buf.numel() * 4][0] / 1e3

    def quantized(x, group, settings):
        seen.append(policy.crossover_bytes(CUDA, x.dtype, group))  # the stand-in: compress
        clock[0] += rank_ms[rank][x.numel() * 4][1] / 1e3

    real = measure.crossover_on_link

    def on_the_cpu(
        dtype, group, sizes=None, warmup=1, iters=3, larger=measure.LARGER_SIZE, device=None
    ):
        assert device == CUDA
        return real(dtype, group, sizes, warmup, iters, larger, torch.device("cpu"))

    with _each_rank_a_node():
        group = dist.new_group()
        info = comm.GroupInfo("nccl", 2, rank, True, False, 1800.0)
        with (
            mock.patch.object(policy, "group_info", lambda g: info),
            mock.patch.object(measure, "crossover_on_link", side_effect=on_the_cpu) as called,
            mock.patch.object(measure, "first_use_sizes", lambda d: (MiB, 4 * MiB)),
            mock.patch.object(measure, "time", stopwatch),
            mock.patch.object(measure.process_group, "allreduce_plain_", plain),
            mock.patch.object(measure, "allreduce", quantized),
        ):
            found = [policy.crossover_bytes(CUDA, torch.float32, group) for _ in range(2)]
        dist.destroy_process_group(group)
    return [found, called.call_count, set(seen)]


def test_ranks_across_hosts_take_the_slowest_ranks_times_and_decide_alike(dist2):
    """Alone, rank 0 would compress from 1 MiB and rank 1 from 4 MiB: both take the slowest
    rank's times, so both compress from 4 MiB; measured once."""
    rank_ms = {0: {MiB: (10, 1), 4 * MiB: (10, 1)}, 1: {MiB: (1, 10), 4 * MiB: (10, 1)}}
    for found, measured, seen in dist2.run(_nccl_across_hosts_agrees, rank_ms):
        assert found == [4 * MiB, 4 * MiB]
        assert measured == 1 and seen == {0}
