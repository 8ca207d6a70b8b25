"""Shared fixtures: gloo process pools of 2 and 4 ranks, and Triton on the CPU."""

import os
import tempfile

import torch

# Crossovers from the built-in tables, whatever this machine's calibration file says.
os.environ["CGX2_CALIBRATION_FILE"] = os.path.join(tempfile.mkdtemp(), "no-calibration.json")

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on the CPU; must be set before they are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from dist_pool import DistPool


@pytest.fixture(scope="session")
def dist2():
    pool = DistPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def dist4():
    pool = DistPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def netlab():
    """:mod:`cgx2.testing.netlab`, or a skip saying why it cannot run here (not root, no
    iproute2): ``netlab.Lab(2, netlab.Link("1gbit"))``."""
    from cgx2.testing import netlab as lab

    reason = lab.unavailable()
    if reason:
        pytest.skip(f"cannot make network namespaces: {reason}")
    return lab
