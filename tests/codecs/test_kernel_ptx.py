"""The max-min kernels as the GPU gets them, built for sm_90 on this CPU-only machine: the
interpreter that runs them elsewhere in the tests cannot show how they round subnormals."""

import os
import subprocess
import sys

import pytest


def _float_ops() -> dict[str, int]:
    here = os.path.dirname(__file__)
    root = os.path.dirname(os.path.dirname(here))  # cgx2 imports from the checkout
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    run = subprocess.run(
        [sys.executable, os.path.join(here, "ptx_ops.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0:
        if "ptxas" in run.stderr and ("No such file" in run.stderr or "not found" in run.stderr):
            pytest.skip("this Triton has no CUDA toolchain (ptxas)")
        raise AssertionError(run.stderr[-3000:])
    return {op: int(n) for op, n in (line.split() for line in run.stdout.splitlines())}


def test_only_the_level_floor_flushes_subnormals():
    """Libdevice is built flushing subnormals (Triton's default), so a division by a
    subnormal span became a division by zero on the GPU only. The one flushing op left is
    the floor's round-down add, where a subnormal input floors to 0 either way."""
    ops = _float_ops()
    flushing = {op for op in ops if ".ftz" in op and not op.startswith("rotated:")}
    assert flushing == {"add.rm.ftz.f32"}, flushing
    assert ops.get("div.rn.f32", 0) > 0 and ops.get("fma.rn.f32", 0) > 0


def test_packed_fields_meet_the_tile_without_shuffles():
    """Each thread loads and stores the packed fields of the groups it codes: laid out for
    vector access instead, they crossed threads by shuffles, 48 of decode-sum-encode's 690
    instructions a tile (``maxmin_triton._group_grid``)."""
    ops = _float_ops()
    assert ops["encode:shfl.sync.idx"] == 0
    assert ops["dse:shfl.sync.idx"] == 0


def test_the_nearest_encoder_builds_without_the_random_stream():
    """The parameter all-gather's encoder (``NEAREST``) compiles for the GPU and draws no
    random numbers: Philox's multiplies are gone from it."""
    ops = _float_ops()
    assert ops["encode:mul.wide.u32"] > 0
    assert ops["nearest:mul.wide.u32"] == 0


def test_the_rotated_kernels_build_without_flushing_subnormals():
    """The Hadamard rotation's kernels (encode, decode-sum-encode, decode) build for the GPU,
    and their butterflies, scale and signs round as the reference does: the level floor's
    round-down add stays their one flushing op, and no add or multiply is fused."""
    ops = _float_ops()
    rotated = {op.removeprefix("rotated:"): n for op, n in ops.items() if op.startswith("rotated:")}
    assert {op for op in rotated if ".ftz" in op} == {"add.rm.ftz.f32"}
    assert rotated["sub.rn.f32"] > ops["sub.rn.f32"]  # the butterflies' differences
    assert rotated["mul.wide.u32"] > ops["encode:mul.wide.u32"]  # the signs' Philox
    assert rotated["fma.rn.f32"] == ops["fma.rn.f32"]  # the scales' rounding toward zero alone


def test_decode_sum_encode_programs_fit_a_multiprocessor_s_registers():
    """Decode-sum-encode launches a fixed number of one-warp programs a multiprocessor, meant
    to be resident together: at 4 rows their registers (the rotated kernel's twice the
    unrotated's) fit the 64K of an sm_90 multiprocessor, else a second wave would run late."""
    import cgx2.codecs.maxmin_triton as mt

    ops = _float_ops()
    if not ops["dse:registers"]:
        pytest.skip("this Triton has no ptxas")
    for name, per_sm in (
        ("dse", mt._DSE_PROGRAMS_PER_SM),
        ("rotated_dse", mt._DSE_ROTATED_PROGRAMS_PER_SM),
    ):
        allocated = -(-ops[f"{name}:registers"] // 8) * 8  # a thread's, in units of 8
        assert allocated * 32 * per_sm <= 65536, (name, ops[f"{name}:registers"], per_sm)
