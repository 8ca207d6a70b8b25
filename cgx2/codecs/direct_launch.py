"""Launch compiled Triton kernels without Triton's per-call dispatch, whose Python (binding,
cache key, launch metadata) is a large part of each codec call's host time: host time is what
the NVLink regime's allreduce waits on (BENCHMARKS.md, "Host time").

Each kernel's compiled variants are kept under a key at least as fine as Triton's own
specialization (tensor dtypes and 16-byte alignment; integers' width, divisibility by 16 and
equality to 1; every constexpr and option), so a key found names the variant Triton would pick.
The first launch of a key, launches under the interpreter, with launch hooks installed or
under an untested Triton take Triton's own path.

Importing this module does not import Triton (the benchmarks import it on machines without
Triton); a :class:`Launcher` is made from a Triton kernel, so Triton is there by then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..config import tuning

if TYPE_CHECKING:
    import triton

__all__ = ["Bound", "Launcher"]

# The launcher's calling convention (grid, stream, function, metadata, hooks, then every
# parameter, constexprs included) is Triton 3.6's, checked there; other versions dispatch.
# None until the first Launcher reads Triton's version.
_TESTED: bool | None = None


def _tested_triton() -> bool:
    global _TESTED
    if _TESTED is None:
        import triton

        _TESTED = triton.__version__.split(".")[:2] == ["3", "6"]
    return _TESTED


def _prefix(compiled: Any) -> tuple:
    """What Triton's launcher takes of ``compiled`` between the stream and the parameters: the
    function and its metadata, and no launch metadata or hooks (direct launches run none)."""
    return (compiled.function, compiled.packed_metadata, None, None, None)


def _spec(arg: Any) -> object:
    """What Triton may specialize ``arg`` on, or finer (``Launcher.__call__`` inlines the
    cases of tensors and ints)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):
        return int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63
    if isinstance(arg, float):
        return float
    return arg


class Launcher:
    """``kernel[grid](*args, **constexprs)``, the compiled variant launched directly once
    Triton has compiled it for these arguments' key."""

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        import triton

        self.runtime = triton.knobs.runtime  # the interpreter flag and launch hooks
        _tested_triton()
        self.kernel = kernel
        self.variants: dict[tuple, Any] = {}
        self.names: list[str] = []  # the parameters, at the first variant (the interpreter's
        self.defaults: dict[str, Any] = {}  # functions have no .params)

    def direct(self) -> bool:
        """Whether launches may bypass Triton's dispatch now (a tested Triton, not turned off,
        not interpreting, no launch hooks)."""
        enter, leave = self.runtime.launch_enter_hook, self.runtime.launch_exit_hook
        return (
            bool(_TESTED)
            and tuning().direct_launch
            and not self.runtime.interpret
            and not enter.calls
            and not leave.calls
        )

    def bound(self, grid: Sequence[int], *args: Any, **constexprs: Any) -> Bound | None:
        """The compiled variant that these arguments launch, bound to ``grid`` and the
        constexprs, once a launch of them compiled it (None before, or where launches take
        Triton's path): for a caller that launches it again with arguments Triton would
        specialize alike (tensors of the same dtypes and 16-byte alignment; equal values of
        the integers the kernel specializes on)."""
        if not self.direct():
            return None
        key, _ = self._key(args, constexprs)
        found = self.variants.get(key)
        if found is None:
            return None
        compiled, _, tail = found
        return Bound(compiled, grid, tail)

    @staticmethod
    def _key(args: Sequence[Any], constexprs: dict[str, Any]) -> tuple[tuple, list]:
        """The variant's key, and the arguments as Triton's launcher takes them."""
        # _spec's key, built inline: a function call per argument cost a large share of the
        # launch. Tensors go to Triton's launcher as their addresses, which it takes as they
        # are, where a tensor costs a data_ptr() call and a driver query of the pointer.
        # torch.cuda.current_device() checks lazy initialization first, at every call.
        key = [torch._C._cuda_getDevice(), *constexprs.items()]
        values = list(args)
        for i, arg in enumerate(args):
            if type(arg) is int:
                key.append((arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63))
            elif isinstance(arg, torch.Tensor):
                address = arg.data_ptr()
                key.append((arg.dtype, address % 16 == 0, arg.is_cuda))
                values[i] = address
            elif arg is None:  # the unrotated coding kernels' signs' key, three a launch
                key.append(None)
            else:
                key.append(_spec(arg))
        return tuple(key), values

    def __call__(self, grid: Sequence[int], *args: Any, **constexprs: Any) -> None:
        if not (_TESTED and tuning().direct_launch) or self.runtime.interpret:
            self.kernel[grid](*args, **constexprs)
            return
        key, values = self._key(args, constexprs)
        found = self.variants.get(key)
        enter, leave = self.runtime.launch_enter_hook, self.runtime.launch_exit_hook
        if found is None or enter.calls or leave.calls:
            compiled = self.kernel[grid](*args, **constexprs)
            if hasattr(compiled, "result"):  # compiled asynchronously
                compiled = compiled.result()
            if not self.names:
                self.names = [p.name for p in self.kernel.params]
                self.defaults = {p.name: p.default for p in self.kernel.params if p.has_default}
            # The parameters after the positional ones (constexprs), fixed by the key.
            tail = [
                constexprs[name] if name in constexprs else self.defaults[name]
                for name in self.names[len(args) :]
            ]
            self.variants[key] = compiled, _prefix(compiled), tail
            return
        compiled, prefix, tail = found
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_1, grid_2, stream, *prefix, *values, *tail)


class Bound:
    """A compiled kernel variant bound to its grid and constexprs (:meth:`Launcher.bound`):
    :meth:`run` launches it with the positional arguments alone, tensors as addresses."""

    __slots__ = ("compiled", "grid", "prefix", "tail")

    def __init__(self, compiled: Any, grid: Sequence[int], tail: list) -> None:
        self.compiled, self.prefix, self.tail = compiled, _prefix(compiled), tail
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)

    def run(self, stream: int, *values: Any) -> None:
        self.compiled.run(*self.grid, stream, *self.prefix, *values, *self.tail)
