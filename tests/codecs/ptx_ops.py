"""Prints the floating-point PTX instructions of the max-min kernels built for sm_90, one
``opcode count`` per line, then each kernel's lane-indexed shuffles (``kernel:shfl.sync.idx
count``). Run in a fresh process with TRITON_INTERPRET=0: Triton builds for
a GPU target on a machine without one (used by test_kernel_ptx.py)."""

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cgx2.codecs import maxmin_triton as mt


def ptx(fn, signature: dict, constexprs: dict, pointers: int) -> str:
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(pointers)}
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": 1, "enable_fp_fusion": False}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


_ROTATION = {"sign_k0": "i64", "sign_k1": "i64", "signs_ptr": "*i64"}
_ROTATION_CONSTEXPRS = {"ROT": 128, "SIGNS_IN_MEMORY": False}


def _signs(signature: dict, constexprs: dict, rotated: bool) -> tuple[dict, dict]:
    """A kernel's signature and constexprs with the rotation's parameters: the signs' key
    after the positional ones, ``ROT`` and ``SIGNS_IN_MEMORY`` last. Not rotated: the key
    None, as the unrotated launches pass it (a constant, no parameter of the build), and
    ``ROT`` 0."""
    positional = {k: v for k, v in signature.items() if v != "constexpr"}
    rest = {k: v for k, v in signature.items() if v == "constexpr"}
    rest.update(dict.fromkeys(_ROTATION_CONSTEXPRS, "constexpr"))
    if rotated:
        return {**positional, **_ROTATION, **rest}, {**constexprs, **_ROTATION_CONSTEXPRS}
    signs = dict.fromkeys(_ROTATION, "constexpr")
    unrotated = {**dict.fromkeys(_ROTATION), "ROT": 0, "SIGNS_IN_MEMORY": False}
    return {**positional, **signs, **rest}, {**constexprs, **unrotated}


def _encode(nearest: bool, tiles: dict, rotated: bool = False) -> str:
    signature = {
        "x_ptr": "*fp32",
        "out_u8": "*u8",
        "numel": "i64",
        "chunk_numel": "i64",
        "row_nbytes": "i64",
        "k0": "i64",
        "k1": "i64",
        "keys_ptr": "*i64",
        "stream0": "i64",
        "skip_chunk": "i64",
        "BITS": "constexpr",
        "B": "constexpr",
        "SKIP_INCOMPLETE": "constexpr",
        "ALIGN": "constexpr",
        "KEYS_IN_MEMORY": "constexpr",
        "BUCKETS": "constexpr",
        "BLOCK": "constexpr",
        "ZERO_GAPS": "constexpr",
        "NEAREST": "constexpr",
    }
    constexprs = {
        "BITS": 4,
        "B": 512,
        "SKIP_INCOMPLETE": False,
        "ALIGN": 16,
        "KEYS_IN_MEMORY": False,
        "ZERO_GAPS": False,
        "NEAREST": nearest,
        **tiles,
    }
    return ptx(mt._encode_kernel, *_signs(signature, constexprs, rotated), 2)


def _registers(text: str) -> int:
    """Registers a thread of ``text`` (PTX for sm_90a) takes, as Triton's ptxas allocates them
    (0 where this Triton has no ptxas)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path  # the one that built the kernels
    except (ImportError, AttributeError, RuntimeError):
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(text)
        run = subprocess.run(
            [ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True, text=True
        )
    return int(re.search(r"Used (\d+) registers", run.stderr).group(1))


def _decode_sum_encode(tiles: dict, rotated: bool = False, rows: int = 2) -> str:
    signature = {
        "in_u8": "*u8",
        "own_ptr": "*fp32",
        "out_u8": "*u8",
        "numel": "i64",
        "row_nbytes": "i64",
        "own_index": "i64",
        "scale": "fp32",
        "k0": "i64",
        "k1": "i64",
        "keys_ptr": "*i64",
        "stream": "i64",
        "NUM_ROWS": "constexpr",
        "SKIP_OWN": "constexpr",
        "BITS": "constexpr",
        "B": "constexpr",
        "SKIP_INCOMPLETE": "constexpr",
        "HAS_OWN": "constexpr",
        "HAS_SCALE": "constexpr",
        "KEYS_IN_MEMORY": "constexpr",
        "BUCKETS": "constexpr",
        "BLOCK": "constexpr",
    }
    constexprs = {
        "NUM_ROWS": rows,
        "SKIP_OWN": True,
        "BITS": 4,
        "B": 512,
        "SKIP_INCOMPLETE": True,
        "HAS_OWN": True,
        "HAS_SCALE": True,
        "KEYS_IN_MEMORY": False,
        **tiles,
    }
    return ptx(mt._decode_sum_encode_kernel, *_signs(signature, constexprs, rotated), 3)


def _decode_rotated(tiles: dict) -> str:
    signature = {
        "in_u8": "*u8",
        "out_ptr": "*bf16",
        "numel": "i64",
        "chunk_numel": "i64",
        "row_nbytes": "i64",
        "BITS": "constexpr",
        "B": "constexpr",
        "SKIP_INCOMPLETE": "constexpr",
        "OUT_BF16": "constexpr",
        "ALIGN": "constexpr",
        "BUCKETS": "constexpr",
        "BLOCK": "constexpr",
    }
    constexprs = {"BITS": 4, "B": 512, "SKIP_INCOMPLETE": False, "OUT_BF16": True, "ALIGN": 16}
    return ptx(mt._decode_kernel, *_signs(signature, {**constexprs, **tiles}, True), 2)


def main() -> None:
    tiles = {"BUCKETS": 1, "BLOCK": 512}
    encode = _encode(False, tiles)
    nearest = _encode(True, tiles)  # the parameter all-gather's variant: it builds, no Philox
    dse = _decode_sum_encode(tiles)
    # The rotated kernels (the Hadamard rotation in registers): they build, and their float
    # operations are counted apart (``rotated:`` lines).
    rotated = _encode(False, tiles, True) + _decode_sum_encode(tiles, True) + _decode_rotated(tiles)
    pattern = r"\b((?:add|sub|mul|div|fma|min|max|cvt)\.[\w.]+)"
    ops = collections.Counter(re.findall(pattern, encode + dse))
    for op, count in sorted(ops.items()):
        print(op, count)
    # Shuffles by lane index move values between threads' layouts (the reductions' shuffles
    # are butterflies).
    for name, text in (("encode", encode), ("dse", dse)):
        print(f"{name}:shfl.sync.idx", text.count("shfl.sync.idx"))
    # Philox's 32x32->64-bit multiplies (mul.wide.u32) are the stochastic variant's alone.
    for name, text in (("encode", encode), ("nearest", nearest)):
        print(f"{name}:mul.wide.u32", text.count("mul.wide.u32"))
    for op, count in sorted(collections.Counter(re.findall(pattern, rotated)).items()):
        print(f"rotated:{op}", count)
    # Decode-sum-encode's grid is sized to the programs a multiprocessor holds at 4 rows.
    print("dse:registers", _registers(_decode_sum_encode(tiles, rows=4)))
    print("rotated_dse:registers", _registers(_decode_sum_encode(tiles, True, rows=4)))


if __name__ == "__main__":
    sys.exit(main())
