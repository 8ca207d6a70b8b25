"""An optimizer stepped inside a DDP communication hook, bucket by bucket as each bucket's
averaged gradient arrives, so that its step overlaps the rest of the backward pass and the bytes.

torch's functional optimizers (``torch.distributed.optim``) do the arithmetic: one per bucket,
stepping the bucket's parameters in one call (multi-tensor where torch.optim would be), their
state one dict kept per parameter for all buckets; around any hook that leaves the averaged
bucket in its buffer (cgx2's hooks, torch's), as ``DDP._register_fused_optim`` is around
``allreduce_hook`` (which steps a parameter at a time).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import _default_to_fused_or_foreach

from ..comm import coding_stream
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
    """The optimizer classes whose functional form in torch keeps its state per parameter,
    made as a parameter is first stepped (those with ``step_param``): those a hook can step
    bucket by bucket, whichever bucket a parameter is in."""
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
            f"in torch that keeps its state per parameter; supported: {names}"
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


class _BucketSteps:
    """Steps a bucket's parameters with one call of a functional optimizer over them.

    One functional optimizer per bucket index, over that bucket's parameters, made afresh
    when DDP rebuilds its buckets (after its first backward pass) and a bucket holds others;
    all of them share one state (Adam's moments, SGD's momentum) keyed by parameter, so a
    parameter's state follows it into whichever bucket it is in. ``foreach`` left out (or
    None) is decided per bucket as ``torch.optim`` decides it (multi-tensor where every
    parameter is on a device with foreach kernels, CUDA; single-tensor on CPU), so the steps
    are bit for bit those of ``optimizer(params, **kwargs).step()`` after the backward pass.
    The steps run one at a time: a bucket's future may complete on any of several threads
    (gloo's, a worker's), and the state is shared."""

    def __init__(self, optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
        from torch.distributed.optim.utils import functional_optim_map

        self._functional = functional_optim_map[optimizer]
        self._kwargs = kwargs
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        # Per bucket (its index, and which of its parameters: all, or the compressed or exact
        # ones): their identities and the functional optimizer over them.
        self._by_bucket: dict[object, tuple[tuple[int, ...], Any]] = {}
        # One stream a GPU for the steps: a future's callbacks each get a stream of torch's
        # pool, whose memory the caching allocator keeps apart, stream by stream.
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        self._over([])  # arguments the optimizer refuses raise here, before any step

    def _over(self, params: list[torch.Tensor]) -> Any:
        kwargs = dict(self._kwargs)
        if kwargs.get("foreach") is None and not kwargs.get("fused"):
            kwargs["foreach"] = _default_to_fused_or_foreach(params, differentiable=False)[1]
        with quiet_torchscript_notice():
            functional = self._functional(params, **kwargs, _allow_empty_param_list=True)
        functional.state = self.state
        return functional

    def step(self, key: object, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """One step of ``params`` (those of a bucket that ``key`` names) with their averaged
        ``grads``; on a GPU, on this optimizer's stream, after the caller's stream's work
        (the bucket's future's), which then waits for the step."""
        if not params:
            return
        ids = tuple(map(id, params))
        with self._lock:
            known = self._by_bucket.get(key)
            if known is None or known[0] != ids:
                known = self._by_bucket[key] = (ids, self._over(params))
            device = grads[0].device
            if device.type != "cuda":
                known[1].step(grads)
                return
            caller = torch.cuda.current_stream(device)
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = coding_stream(device)
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                known[1].step(grads)
            caller.wait_stream(stream)


def optimizer_in_hook(
    hook: Hook,
    optimizer: type[torch.optim.Optimizer],
    optimizer_kwargs: Mapping[str, Any] | None = None,
) -> Hook:
    """``hook`` followed, on each bucket as its future completes, by one step of
    ``optimizer`` (its functional form, built from ``optimizer_kwargs``, with a state of its
    own) over the bucket's parameters, with the bucket's averaged gradient: multi-tensor
    (``foreach``) where ``optimizer(params, **optimizer_kwargs)`` would be, as on CUDA, else
    single-tensor, bit for bit as that optimizer stepped after the backward pass. Where
    :func:`cgx_hook` holds a bucket's exact layers for the last bucket (NCCL), its compressed
    layers are stepped as soon as they are averaged and its exact ones once they are. ``hook``
    must leave the gradient in the bucket's buffer, as cgx2's hooks and torch's do. Register the
    result in ``hook``'s place, with its state; then call no optimizer's ``step`` (see
    :func:`cgx2.ddp.compress`'s ``optimizer``)."""
    steps = _BucketSteps(optimizer, check_optimizer(optimizer, optimizer_kwargs))

    def wrapped(hook_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        cgx = isinstance(hook_state, CGXState)
        if cgx:  # the hook then hands over a future of each bucket's compressed layers
            hook_state.optimizer_in_hook = True
        index = bucket.index()
        # As torch's _hook_then_optimizer: the bucket's gradients are views of its buffer.
        params, grads = bucket.parameters(), bucket.gradients()
        averaged = hook(hook_state, bucket)
        ready = hook_state.take_compressed_ready(index) if cgx else None
        if ready is None:

            def step(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                fut.value()  # the hook's error, where it failed, rather than a step on its bucket
                steps.step(index, params, grads)
                return bucket.buffer()

            return averaged.then(step)
        # The hook holds this bucket's exact layers for the last bucket: its compressed layers
        # are stepped as soon as they are averaged, the exact ones once they are.
        compressed, layers = ready
        first = set(layers)
        rest = [i for i in range(len(params)) if i not in first]

        def step_compressed(fut: torch.futures.Future[torch.Tensor]) -> None:
            fut.value()
            steps.step(
                (index, "compressed"), [params[i] for i in layers], [grads[i] for i in layers]
            )

        stepped = compressed.then(step_compressed)

        def step_exact(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            fut.value()
            stepped.wait()  # its error, where it raised
            steps.step((index, "exact"), [params[i] for i in rest], [grads[i] for i in rest])
            return bucket.buffer()

        return averaged.then(step_exact)

    # DDP checks a hook's annotations as objects; this module's are strings (__future__).
    wrapped.__annotations__ = {
        "hook_state": Any,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    # DDP logs a hook by its qualified name.
    name = getattr(hook, "__qualname__", type(hook).__name__)
    wrapped.__name__ = wrapped.__qualname__ = f"{name}_then_{optimizer.__name__}"
    return wrapped
