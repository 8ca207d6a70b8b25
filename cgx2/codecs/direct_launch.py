"""Launch compiled Triton kernels without Triton's per-call dispatch, whose Python (binding,
cache key, launch metadata) took 4-7 us of each codec call's host time on an H200 machine
(bench/launch_overhead.py): host time is what the NVLink regime's allreduce waits on.

Each kernel's compiled variants are kept under a key at least as fine as Triton's own
specialization (tensor dtypes and 16-byte alignment; integers' width, divisibility by 16 and
equality to 1; every constexpr and option), so a key found names the variant Triton would pick.
The first launch of a key, launches under the interpreter, with launch hooks installed or
under an untested Triton take Triton's own path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton

__all__ = ["ENABLED", "Launcher"]

ENABLED = True
"""False: every launch takes Triton's own path (to compare them: bench/launch_overhead.py)."""

# The launcher's calling convention (grid, stream, function, metadata, hooks, then every
# parameter, constexprs included) is Triton 3.6's, checked there; other versions dispatch.
_TESTED = triton.__version__.split(".")[:2] == ["3", "6"]


def _spec(arg: Any) -> object:
    """What Triton may specialize ``arg`` on, or finer."""
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
        self.kernel = kernel
        self.variants: dict[tuple, Any] = {}
        self.names: list[str] = []  # the parameters, at the first variant (the interpreter's
        self.defaults: dict[str, Any] = {}  # functions have no .params)

    def __call__(self, grid: Sequence[int], *args: Any, **constexprs: Any) -> None:
        if not (ENABLED and _TESTED) or triton.knobs.runtime.interpret:
            self.kernel[grid](*args, **constexprs)
            return
        device = torch.cuda.current_device()
        key = (device, tuple(constexprs.items()), tuple(map(_spec, args)))
        compiled = self.variants.get(key)
        enter, leave = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
        if compiled is None or enter.calls or leave.calls:
            compiled = self.kernel[grid](*args, **constexprs)
            if hasattr(compiled, "result"):  # compiled asynchronously
                compiled = compiled.result()
            self.variants[key] = compiled
            if not self.names:
                self.names = [p.name for p in self.kernel.params]
                self.defaults = {p.name: p.default for p in self.kernel.params if p.has_default}
            return
        values = list(args)
        for name in self.names[len(args) :]:
            values.append(constexprs[name] if name in constexprs else self.defaults[name])
        stream = torch._C._cuda_getCurrentRawStream(device)
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                     None, None, None, *values)  # fmt: skip
