"""The direct launcher dispatches through Triton once per specialization key, then calls the
compiled variant with every parameter in order; anything Triton specializes on makes a new key.
(The launches themselves run on GPUs: bench/gpu_check.py compares their bytes.)"""

import pytest
import torch

from cgx2 import config

triton = pytest.importorskip("triton", reason="Triton is not installed")
direct_launch = pytest.importorskip("cgx2.codecs.direct_launch")


def _kernel(x_ptr, n, scale, B: triton.language.constexpr, FLAG: triton.language.constexpr = 7):
    pass


_PARAMS = triton.JITFunction(_kernel).params  # as compiled (the interpreter's have none)


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def run(self, *args) -> None:
        self.runs.append(args)


class _Kernel:
    """``_kernel``'s parameters; indexing by a grid records Triton's own launch."""

    params = _PARAMS

    def __init__(self) -> None:
        self.dispatched: list[tuple] = []
        self.compiled: list[_Compiled] = []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.dispatched.append((grid, args, constexprs))
            self.compiled.append(_Compiled())
            return self.compiled[-1]

        return launch


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(direct_launch, "_TESTED", True)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    launch = direct_launch.Launcher(_kernel)
    launch.kernel = _Kernel()
    return launch


def test_first_launch_dispatches_then_direct_with_every_parameter(launcher):
    x = torch.zeros(64)
    launcher((3, 2), x, 100, 0.5, B=512, num_warps=1)
    assert len(launcher.kernel.dispatched) == 1
    launcher((5, 2), x, 100, 0.25, B=512, num_warps=1)
    assert len(launcher.kernel.dispatched) == 1
    # grid (z 1), stream, function, metadata, no launch metadata or hooks, then every
    # parameter in order (a tensor as its address), FLAG's default included; num_warps is an
    # option, not a parameter.
    assert launcher.kernel.compiled[0].runs == [
        (5, 2, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), 100, 0.25, 512, 7)
    ]


@pytest.mark.parametrize(
    "change",
    [
        lambda x: ((x[1:],), {}),  # 4-byte offset: no longer 16-byte aligned
        lambda x: ((x.double(),), {}),
        lambda x: ((x, True), {}),  # a bool, not the int 1
        lambda x: ((x, 2**63), {}),  # unsigned 64-bit
        lambda x: ((x, 1), {}),  # Triton makes an int of 1 a constant
        lambda x: ((x, 96), {}),  # divisible by 16
        lambda x: ((x, 2**31), {}),  # 64-bit
        lambda x: ((x, None), {}),  # None: a constant to Triton
        lambda x: ((), {"B": 256}),
        lambda x: ((), {"FLAG": 7}),  # the default passed by name: a new key, the same kernel
        lambda x: ((), {"num_warps": 2}),
    ],
)
def test_what_triton_specializes_on_makes_a_new_key(launcher, change):
    x = torch.zeros(64)
    args, kwargs = [x, 100, 0.5], {"B": 512, "num_warps": 1}
    launcher((1,), *args, **kwargs)
    new_args, new_kwargs = change(x)
    args[: len(new_args)] = new_args
    launcher((1,), *args, **{**kwargs, **new_kwargs})
    assert len(launcher.kernel.dispatched) == 2
    launcher((1,), *args, **{**kwargs, **new_kwargs})
    assert len(launcher.kernel.dispatched) == 2  # and that key is kept


def test_a_none_parameter_is_keyed_inline_and_passed_as_none(launcher, monkeypatch):
    """None (the unrotated coding kernels' signs' key, three a launch) launches directly after
    its first launch, keyed without _spec's function call, and reaches the variant as None."""
    x = torch.zeros(64)
    launcher((1,), x, None, 3, B=512)
    monkeypatch.setattr(direct_launch, "_spec", lambda arg: pytest.fail(f"_spec({arg!r})"))
    launcher((1,), x, None, 3, B=512)
    assert len(launcher.kernel.dispatched) == 1
    runs = launcher.kernel.compiled[0].runs
    assert runs == [(1, 1, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), None, 3, 512, 7)]


def test_disabled_hooked_or_interpreted_launches_dispatch(launcher, monkeypatch):
    x = torch.zeros(64)
    launcher((1,), x, 100, 0.5, B=512)
    with config.tuned(direct_launch=False):
        launcher((1,), x, 100, 0.5, B=512)
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(print)
    try:
        launcher((1,), x, 100, 0.5, B=512)
    finally:
        hook.remove(print)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    launcher((1,), x, 100, 0.5, B=512)
    assert len(launcher.kernel.dispatched) == 4
    assert not launcher.kernel.compiled[0].runs


def test_a_bound_variant_runs_as_the_launcher_would(launcher):
    """None before the first launch of a key (or while launches dispatch); after it, the
    variant bound to its grid and constexprs, run with the positional arguments alone."""
    x = torch.zeros(64)
    assert launcher.bound((3, 2), x, 100, 0.5, B=512, num_warps=1) is None
    launcher((3, 2), x, 100, 0.5, B=512, num_warps=1)
    bound = launcher.bound((3, 2), x, 100, 0.5, B=512, num_warps=1)
    assert bound is not None
    assert launcher.bound((3, 2), x, 100, 0.5, B=256, num_warps=1) is None  # another key
    bound.run(1234, x.data_ptr(), 100, 0.25)
    launcher((3, 2), x, 100, 0.25, B=512, num_warps=1)
    runs = launcher.kernel.compiled[0].runs
    assert (
        runs[0]
        == runs[1]
        == (3, 2, 1, 1234, "fn", "meta", None, None, None, x.data_ptr(), 100, 0.25, 512, 7)
    )
    with config.tuned(direct_launch=False):
        assert launcher.bound((3, 2), x, 100, 0.5, B=512, num_warps=1) is None
        assert not launcher.direct()
