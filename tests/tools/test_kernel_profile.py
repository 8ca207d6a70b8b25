"""bench/kernel_profile.py's reading of Nsight Compute's CSV pages (the profiling itself runs on
GPUs), on pages written here in ncu's layout."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def _load() -> ModuleType:
    path = Path(__file__).parents[2] / "bench" / "kernel_profile.py"
    spec = importlib.util.spec_from_file_location("kernel_profile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kp = _load()

DETAILS_HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def _details_row(section: str, name: str, unit: str, value: str) -> str:
    return (
        f'"0","541","python3.12","127.0.0.1","_k","1","7","(32, 1, 1)","(2112, 1, 1)","0",'
        f'"9.0","{section}","{name}","{unit}","{value}"'
    )


def test_details_metrics_and_units() -> None:
    rows = [
        ("GPU Speed Of Light Throughput", "Duration", "ms", "0.03149"),
        ("GPU Speed Of Light Throughput", "SM Frequency", "Mhz", "1,960"),
        ("GPU Speed Of Light Throughput", "DRAM Throughput", "%", "65.90"),
        ("Compute Workload Analysis", "Issued Ipc Active", "inst/cycle", "2.81"),
        ("Launch Statistics", "Grid Size", "", "2,112"),
        ("Launch Statistics", "Registers Per Thread", "register/thread", "80"),
        ("Occupancy", "Achieved Occupancy", "%", "21.69"),
        # Same name, other section: not the metric asked for.
        ("Memory Workload Analysis", "Duration", "us", "999"),
        ("Occupancy", "Block Limit Registers", "block", "24"),
    ]
    text = "\n".join([DETAILS_HEADER, *(_details_row(*r) for r in rows)])
    got = kp.parse_details(text)
    assert got == pytest.approx(
        {
            "duration": 31.49,
            "sm_frequency": 1.96,
            "dram_pct": 65.9,
            "issued_ipc": 2.81,
            "grid": 2112,
            "registers": 80,
            "achieved_occupancy_pct": 21.69,
        }
    )


SOURCE_HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Thread Instructions Executed",'
    '"stall_wait","stall_math","stall_wait (Not Issued)","stall_selected"'
)
SOURCE = f"""\
"Kernel Name","_decode_sum_encode_kernel",
{SOURCE_HEADER}
"0x0","      FADD R1, R2, R3","6","3,200","2","1","9","3"
"0x10","  @P0 FADD R1, R2, R3","2","800","0","2","9","0"
"0x20","      IMAD.WIDE.U32 R4, R5, 0x3, RZ","4","1,600","4","0","9","0"
"0x30","      LDG.E.128 R8, desc[UR4][R2.64]","0","-","0","0","0","0"
"""


def test_source_counts_per_value_and_stall_shares() -> None:
    got = kp.parse_source(SOURCE, values=800)
    # FADD 3200 + 800 (its predicated copy counts as FADD) over 800 values; IMAD.WIDE 1600.
    assert got["opcodes_per_value"] == {"FADD": 5.0, "IMAD.WIDE.U32": 2.0}
    assert got["instructions_per_value"] == 7.0
    # 12 samples: wait 6, math 3, selected 3; the "(Not Issued)" copies are not counted again.
    assert got["stalls"] == {"wait": 0.5, "math": 0.25, "selected": 0.25}


def test_source_without_a_sass_table_is_refused() -> None:
    with pytest.raises(ValueError, match="no SASS table"):
        kp.parse_source('"Kernel Name","_k",\n"Line","Source"\n', values=1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("dse:fp16:4", "KERNEL:DTYPE:BITS"),
        ("scan:fp32:4", "KERNEL:DTYPE:BITS"),
        ("dse:fp32", "KERNEL:DTYPE:BITS"),
        ("dse:fp32:9", "bits must be 1-8"),
        ("encode:bf16:x", "bits must be 1-8"),
    ],
)
def test_bad_kernel_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kp.parse_spec(spec)


def test_specs_and_values() -> None:
    assert kp.parse_spec("dse:bf16:2") == ("dse", "bf16", 2)
    assert kp.values_of("dse", 64 << 20) == 16 << 20
    assert kp.values_of("encode", 64 << 20) == 64 << 20


def test_summary_keeps_the_commonest_in_order() -> None:
    result = {
        "stalls": {"wait": 0.5, "math": 0.2, "selected": 0.15, "long_sb": 0.1, "mio": 0.05},
        "opcodes_per_value": {f"OP{i}": 7.0 - i for i in range(7)},
    }
    stalls, opcodes = kp.summary(result)
    assert stalls == "wait 50%, math 20%, selected 15%, long_sb 10%"
    assert opcodes == "OP0 7.0, OP1 6.0, OP2 5.0, OP3 4.0, OP4 3.0, OP5 2.0"
