"""Builds cgx2's C++ extension, ``cgx2._C`` (``csrc/``): the codec's CPU loops and the
shared-memory transport. It needs a C++17 compiler and pybind11 (a build requirement in
pyproject.toml); where it cannot be built, the install goes on without it and cgx2 logs which
parts run in torch instead (cgx2/extension.py)."""

import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

extensions = []
if sys.platform.startswith("linux"):  # futexes, /proc and POSIX shared memory
    extensions.append(
        Pybind11Extension(
            "cgx2._C",
            sorted(
                [
                    "csrc/module.cc",
                    "csrc/maxmin_codec.cc",
                    "csrc/nccl.cc",
                    "csrc/rotation.cc",
                    "csrc/shm.cc",
                ]
            ),
            cxx_std=17,
            # No fused multiply-adds and no fast math: the codec's loops round each operation
            # as IEEE fp32, as the torch reference does, so their bytes are the reference's.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            libraries=["rt", "dl"],
            optional=True,
        )
    )

setup(ext_modules=extensions, cmdclass={"build_ext": build_ext})
