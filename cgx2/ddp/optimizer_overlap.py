"""An optimizer stepped inside a DDP communication hook, bucket by bucket as each bucket's
averaged gradient arrives, so that its step overlaps the rest of the backward pass and the bytes.

torch's pieces do the work: its functional optimizers (``as_functional_optim``, each with its
own per-parameter state) and ``_hook_then_optimizer``, which ``DDP._register_fused_optim``
puts around ``allreduce_hook``; here they go around any hook that leaves the averaged bucket in
its buffer (cgx2's hooks, torch's).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks import (
    _hook_then_optimizer,
    _OptimizerHookState,
)

from .cgx_hook import CGXState

__all__ = [
    "check_optimizer",
    "optimizer_in_hook",
    "quiet_torchscript_notice",
    "supported_optimizers",
]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]

# torch warns at each functional optimizer it builds that their TorchScript form is deprecated
# and points at torch.compile's optimizer: advice for code that scripts them, not for its
# users, who cannot act on it.
_TORCHSCRIPT_NOTICE = "`TorchScript` support for functional optimizers is deprecated"


def supported_optimizers() -> tuple[type[torch.optim.Optimizer], ...]:
    """The optimizer classes torch has a functional form for that steps one parameter at a
    time (``step_param``): those a hook can step bucket by bucket."""
    from torch.distributed.optim.utils import functional_optim_map

    return tuple(
        cls for cls, functional in functional_optim_map.items() if hasattr(functional, "step_param")
    )


def check_optimizer(
    optimizer: type[torch.optim.Optimizer] | None,
    optimizer_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """``optimizer_kwargs`` as a dict, once ``optimizer`` is found a class torch can step in a
    hook; a clear ``TypeError``/``ValueError`` naming the argument otherwise."""
    if optimizer is None:
        if optimizer_kwargs is not None:
            raise ValueError("optimizer_kwargs were given without an optimizer to pass them to")
        return {}
    if not isinstance(optimizer, type):
        raise TypeError(
            "optimizer must be an optimizer class, e.g. torch.optim.AdamW, with its arguments "
            f"in optimizer_kwargs (not its parameters: each bucket's), got {optimizer!r}"
        )
    supported = supported_optimizers()
    if optimizer not in supported:
        names = ", ".join(f"torch.optim.{cls.__name__}" for cls in supported)
        raise ValueError(
            f"optimizer={optimizer.__module__}.{optimizer.__qualname__} has no functional form "
            f"in torch that steps a parameter at a time; supported: {names}"
        )
    if optimizer_kwargs is not None and not isinstance(optimizer_kwargs, Mapping):
        raise TypeError(
            f"optimizer_kwargs must be a mapping of {optimizer.__name__}'s arguments, got "
            f"{type(optimizer_kwargs).__name__}"
        )
    return dict(optimizer_kwargs or {})


@contextlib.contextmanager
def quiet_torchscript_notice() -> Iterator[None]:
    """Within: torch's notice that functional optimizers' TorchScript form is deprecated is
    dropped; other warnings pass as they would have."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # recorded here, filtered when passed on
        yield
    for w in caught:
        if _TORCHSCRIPT_NOTICE not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


class _Serialized:
    """A functional optimizer whose steps run one at a time: a bucket's future may complete
    on any of several threads (gloo's, a worker's), and the optimizer's state is shared."""

    def __init__(self, functional: Any) -> None:
        self.functional = functional
        self._lock = threading.Lock()

    def step_param(self, param: torch.Tensor, grad: torch.Tensor | None) -> None:
        with self._lock:
            self.functional.step_param(param, grad)


def optimizer_in_hook(
    hook: Hook,
    optimizer: type[torch.optim.Optimizer],
    optimizer_kwargs: Mapping[str, Any] | None = None,
) -> Hook:
    """``hook`` followed, on each bucket as its future completes, by a step of ``optimizer``
    (its functional form, built from ``optimizer_kwargs``, with a state of its own) on each of
    the bucket's parameters, with the bucket's averaged gradient. ``hook`` must leave that
    gradient in the bucket's buffer, as cgx2's hooks and torch's do. Register the result in
    ``hook``'s place, with its state; then call no optimizer's ``step`` (see
    :func:`cgx2.ddp.compress`'s ``optimizer``)."""
    kwargs = check_optimizer(optimizer, optimizer_kwargs)
    from torch.distributed.optim import as_functional_optim

    with quiet_torchscript_notice():
        functional = as_functional_optim(optimizer, **kwargs)
    then_step = _hook_then_optimizer(hook, _OptimizerHookState(_Serialized(functional)))

    def wrapped(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if isinstance(hook_state, CGXState):
            hook_state.optimizer_in_hook = True  # each bucket's future set as it is averaged
        return then_step(hook_state, bucket)

    # DDP checks a hook's annotations as objects; this module's are strings (__future__).
    wrapped.__annotations__ = dict(then_step.__annotations__)
    # DDP logs a hook by its qualified name.
    name = getattr(hook, "__qualname__", type(hook).__name__)
    wrapped.__name__ = wrapped.__qualname__ = f"{name}_then_{optimizer.__name__}"
    return wrapped
