"""Shared fixtures: gloo process pools of 2 and 4 ranks, Triton on the CPU, and a monkeypatch
whose changes to the environment reach cgx2's settings (read once)."""

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

import cgx2.config


class _MonkeyPatch(pytest.MonkeyPatch):
    """pytest's ``monkeypatch`` whose changes to the environment reach cgx2's settings, which
    cgx2 reads once (:func:`cgx2.config.refresh` takes them again, at their next use)."""

    def setenv(self, name: str, value: str, prepend: str | None = None) -> None:
        super().setenv(name, value, prepend)
        cgx2.config.refresh()

    def delenv(self, name: str, raising: bool = True) -> None:
        super().delenv(name, raising)
        cgx2.config.refresh()

    def undo(self) -> None:
        super().undo()
        cgx2.config.refresh()


@pytest.fixture
def monkeypatch():
    """pytest's own fixture, whose environment reaches cgx2 (:class:`_MonkeyPatch`)."""
    patch = _MonkeyPatch()
    yield patch
    patch.undo()


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
