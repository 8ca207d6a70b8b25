"""CGX_* environment variables: CGX's defaults, parsing, and errors naming the variable."""

import pytest

from cgx2.config import CGXConfig


def test_defaults_are_cgx_defaults():
    cfg = CGXConfig.from_env({})
    assert cfg.quantization_bits == 32 and not cfg.compression_enabled
    assert cfg.bucket_size == 512
    assert cfg.skip_incomplete_buckets is False
    assert cfg.minimal_size == 16  # default 0, raised to 16
    assert cfg.fusion_buffer_size_mb == 64
    assert cfg.inner_communicator == "SHM"
    assert cfg.cross_communicator == "MPI"
    assert cfg.intra_broadcast is False


def test_reads_every_variable():
    cfg = CGXConfig.from_env(
        {
            "CGX_COMPRESSION_QUANTIZATION_BITS": "4",
            "CGX_COMPRESSION_BUCKET_SIZE": "1024",
            "CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS": "1",
            "CGX_COMPRESSION_MINIMAL_SIZE": "4096",
            "CGX_FUSION_BUFFER_SIZE_MB": "32",
            "CGX_INNER_COMMUNICATOR_TYPE": "nccl",
            "CGX_CROSS_COMMUNICATOR_TYPE": "NCCL",
            "CGX_INTRA_BROADCAST": "1",
        }
    )
    assert cfg == CGXConfig(4, 1024, True, 4096, 32, "NCCL", "NCCL", True)
    assert cfg.compression_enabled


def test_minimal_size_floored_at_16():
    assert CGXConfig.from_env({"CGX_COMPRESSION_MINIMAL_SIZE": "3"}).minimal_size == 16
    assert CGXConfig(minimal_size=0).minimal_size == 16


def test_reads_os_environ(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "3")
    assert CGXConfig.from_env().quantization_bits == 3


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "0", "1..8"),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "9", "1..8"),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "16", "1..8"),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "33", "1..8"),
        ("CGX_COMPRESSION_QUANTIZATION_BITS", "four", "integer"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "0", "1..1048576"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "-5", "1..1048576"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "2147483647", "1..1048576"),
        ("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS", "2", "0/1, true/false"),
        ("CGX_COMPRESSION_MINIMAL_SIZE", "-1", ">= 0"),
        ("CGX_FUSION_BUFFER_SIZE_MB", "x", "integer"),
        ("CGX_INNER_COMMUNICATOR_TYPE", "TCP", "SHM, MPI, NCCL"),
        ("CGX_CROSS_COMMUNICATOR_TYPE", "SHM", "MPI, NCCL"),
        ("CGX_INTRA_BROADCAST", "maybe", "0/1, true/false"),
    ],
)
def test_invalid_value_names_variable_and_range(var, value, expected):
    with pytest.raises(ValueError) as info:
        CGXConfig.from_env({var: value})
    assert var in str(info.value)
    assert expected in str(info.value)


def test_config_is_frozen():
    cfg = CGXConfig()
    with pytest.raises(AttributeError):
        cfg.bucket_size = 3  # type: ignore[misc]


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="quantization_bits"):
        CGXConfig(quantization_bits=12)
    with pytest.raises(ValueError, match="bucket_size"):
        CGXConfig(bucket_size=0)


def test_tuning_reads_every_cgx2_variable():
    from cgx2.config import TuningConfig

    found = TuningConfig.from_env(
        {
            "CGX2_CROSSOVER_BYTES": "4M",
            "CGX2_CUDA_GRAPHS": "on",
            "CGX2_PIPELINE_BYTES": "64MiB",
            "CGX2_PAIR_GATHER": "0",
            "CGX2_CALIBRATION_FILE": "/x/c.json",
            "CGX2_DIRECT_LAUNCH": "no",
            "CGX2_NATIVE": "false",
            "CGX2_CACHE_DIR": "/c",
            "CGX2_COMM_WORKER": "0",
            "CGX2_TRANSPORT": "SHM",
            "CGX2_ALGORITHM": "ring",
            "CGX2_CHECK_AGREEMENT": "Deferred",
            "CGX2_NODE_MESH": "0",
        }
    )
    assert found == TuningConfig(
        crossover_bytes=4 << 20,
        cuda_graphs=True,
        pipeline_bytes=64 << 20,
        pair_gather=False,
        comm_worker=False,
        calibration_file="/x/c.json",
        direct_launch=False,
        native_codec=False,
        cache_dir="/c",
        transport="shm",
        algorithm="ring",
        check_agreement="deferred",
        node_mesh=False,
    )
    default = TuningConfig.from_env({"CGX2_CACHE_DIR": "/c"})
    assert default.crossover_bytes is None and default.pipeline_bytes is None
    assert default.comm_worker and default.pair_gather and default.node_mesh is None
    assert TuningConfig.from_env({"CGX2_NODE_MESH": "on"}).node_mesh is True
    assert default.transport == default.algorithm == default.check_agreement == "auto"
    for raw, mode in [("1", "on"), ("yes", "on"), ("0", "off"), ("false", "off"), ("auto", "auto")]:
        assert TuningConfig.from_env({"CGX2_CHECK_AGREEMENT": raw}).check_agreement == mode
    assert default.calibration_file == "/c/calibration.json"  # beside the cache by default
    assert TuningConfig.from_env({"CGX2_CROSSOVER_BYTES": "auto"}).crossover_bytes is None


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("CGX2_PIPELINE_BYTES", "0"),
        ("CGX2_CROSSOVER_BYTES", "-1"),
        ("CGX2_CROSSOVER_BYTES", "4 TB"),
        ("CGX2_PAIR_GATHER", "maybe"),
        ("CGX2_NATIVE", "2"),
        ("CGX2_COMM_WORKER", "x"),
        ("CGX2_TRANSPORT", "tcp"),
        ("CGX2_ALGORITHM", "tree"),
        ("CGX2_CHECK_AGREEMENT", "later"),
        ("CGX2_NODE_MESH", "flat"),
    ],
)
def test_a_bad_cgx2_variable_is_named(var, value):
    from cgx2.config import TuningConfig

    with pytest.raises(ValueError, match=f"{var}='{value}' is invalid"):
        TuningConfig.from_env({var: value})


def test_launch_variables_and_a_bad_one_named():
    from cgx2.config import LaunchConfig

    launch = LaunchConfig.from_env(
        {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "NCCL_P2P_DISABLE": "1"}
    )
    assert launch.spans_nodes and launch.nccl_p2p_disabled and not launch.nccl_shm_disabled
    assert not LaunchConfig.from_env({}).spans_nodes
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='two'"):
        LaunchConfig.from_env({"LOCAL_WORLD_SIZE": "two"})


def test_tuned_overrides_nests_and_restores():
    from cgx2 import config

    before = config.tuning()
    with config.tuned(pair_gather=False) as outer:
        assert outer.pair_gather is False and config.tuning() is outer
        with config.tuned(crossover_bytes=0):
            assert config.tuning().pair_gather is False and config.crossover_override() == 0
        assert config.tuning().crossover_bytes == before.crossover_bytes
    assert config.tuning() == before
    with pytest.raises(TypeError, match="no field"), config.tuned(bits=4):
        pass


def test_parse_bytes():
    from cgx2.config import parse_bytes

    assert [parse_bytes(t) for t in ("12", "64K", "1M", "2GiB", "3 MB")] == [
        12,
        64 << 10,
        1 << 20,
        2 << 30,
        3 << 20,
    ]
    assert parse_bytes("lots") is None and parse_bytes("-1") is None
