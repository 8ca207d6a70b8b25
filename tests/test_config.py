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
        ("CGX_COMPRESSION_BUCKET_SIZE", "0", "1..2147483647"),
        ("CGX_COMPRESSION_BUCKET_SIZE", "-5", "1..2147483647"),
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
