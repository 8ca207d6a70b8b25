"""Error feedback: what a rank's quantization took from a gradient, added back at the next step;
residuals are kept per parameter, survive DDP's bucket rebuild and go into checkpoints."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from .param_numbers import ParamNumbers

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Residuals of a lossy reduction, one flat tensor per key.

    A step is ``add_(key, g)`` (``g += residual``, in place), the reduction of ``g``, then
    ``update_(key, g_sent, decoded)`` (residual = what was put in − what the peers decode of
    it) or ``store_(key, residual)`` when the reduction computed the residual itself.

    Keys are small integers. :meth:`key` numbers parameters in the order it first meets them:
    under DDP, the order of the first iteration's buckets, which the model's parameter order
    and ``bucket_cap_mb`` fix; so a parameter keeps its key when DDP rebuilds its buckets
    after the first iteration (buckets and positions change, the parameter does not), and a
    run resumed from a checkpoint into a freshly built model gives each parameter the key it
    had. Parameters are held weakly. Each key's parameter shape is kept with the residuals,
    so a checkpoint loaded into another model is refused where the shapes tell (parameters of
    one shape numbered in another order cannot be told apart).

    Non-finite values never enter a residual: a step whose gradient overflowed (which fp16
    training with a ``GradScaler`` expects now and then, and skips) would otherwise carry
    inf or NaN into every later step.
    """

    def __init__(self) -> None:
        self._numbers = ParamNumbers()
        self._residuals: dict[int, torch.Tensor] = {}
        self._shapes: dict[int, tuple[int, ...]] = {}

    def key(self, param: torch.Tensor) -> int:
        """``param``'s stable key (a new one the first time it is seen)."""
        key, new = self._numbers.number(param)
        if new:
            shape = self._shapes.setdefault(key, tuple(param.shape))
            if shape != tuple(param.shape):
                raise ValueError(
                    f"error feedback: residual {key} was saved for a parameter of shape "
                    f"{shape}, met here by one of shape {tuple(param.shape)}; load a "
                    "checkpoint into the model it came from, built the same way"
                )
        return key

    def keys(self, params: Iterable[torch.Tensor]) -> list[int]:
        """:meth:`key` of each parameter, in order."""
        return [self.key(p) for p in params]

    def residual(self, key: int) -> torch.Tensor | None:
        """The flat residual held for ``key`` (None: none yet)."""
        return self._residuals.get(key)

    def add_(self, key: int, grad: torch.Tensor) -> torch.Tensor:
        """``grad += residual`` in place (nothing when there is none); returns ``grad``."""
        r = self._residuals.get(key)
        if r is None:
            return grad
        if r.numel() != grad.numel():
            raise ValueError(
                f"error feedback: the residual of key {key} has {r.numel()} values, its layer "
                f"{grad.numel()}; load a checkpoint into the model (and settings) it came from"
            )
        if r.device != grad.device or r.dtype != grad.dtype:  # e.g. loaded onto the CPU
            r = self._residuals[key] = r.to(device=grad.device, dtype=grad.dtype)
        grad.add_(r.view(grad.shape))
        return grad

    def add_many_(self, keys: Iterable[int], grads: Iterable[torch.Tensor]) -> None:
        """:meth:`add_` of each key to each gradient, the additions in one ``_foreach`` call
        (a bucket holds hundreds of layers; one kernel each would cost a launch each)."""
        targets, residuals = [], []
        for key, grad in zip(keys, grads, strict=True):
            r = self._residuals.get(key)
            if r is None:
                continue
            if r.numel() != grad.numel():
                self.add_(key, grad)  # raises, naming the key
            if r.device != grad.device or r.dtype != grad.dtype:  # e.g. loaded onto the CPU
                r = self._residuals[key] = r.to(device=grad.device, dtype=grad.dtype)
            targets.append(grad)
            residuals.append(r.view(grad.shape))
        if targets:
            torch._foreach_add_(targets, residuals)

    def store_many_(self, keys: Iterable[int], residuals: Iterable[torch.Tensor]) -> None:
        """:meth:`store_` of each residual; when all are views of one tensor (a fused
        buffer's slices), its non-finite values are zeroed in one call, not one per layer."""
        residuals = list(residuals)
        base = residuals[0]._base if residuals else None
        if base is not None and all(r._base is base for r in residuals):
            base.nan_to_num_(0.0, 0.0, 0.0)
            for key, residual in zip(keys, residuals, strict=True):
                self._residuals[key] = residual.reshape(-1)
        else:
            for key, residual in zip(keys, residuals, strict=True):
                self.store_(key, residual)

    def update_(self, key: int, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep ``sent − decoded`` (computed in fp32, stored in ``sent``'s dtype)."""
        error = sent.reshape(-1).float() - decoded.reshape(-1).float()
        self._residuals[key] = error.nan_to_num_(0.0, 0.0, 0.0).to(sent.dtype)

    def store_(self, key: int, residual: torch.Tensor) -> None:
        """Keep ``residual`` itself (not copied: the caller hands over a fresh tensor, whose
        non-finite values are zeroed in place)."""
        self._residuals[key] = residual.reshape(-1).nan_to_num_(0.0, 0.0, 0.0)

    def clear(self) -> None:
        """Forget every residual; parameters keep their keys."""
        self._residuals.clear()

    def discard_(self, key: int) -> None:
        """Forget ``key``'s residual (its layer was reduced exactly: nothing is owed)."""
        self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, object]:
        """The residuals by key (copies, on their devices), their parameters' shapes and the
        rank they belong to (:meth:`load_state_dict` refuses them on another)."""
        residuals = {k: r.detach().clone() for k, r in self._residuals.items()}
        shapes = {k: list(self._shapes[k]) for k in residuals if k in self._shapes}
        return {"residuals": residuals, "shapes": shapes, "rank": _rank()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Replace the residuals with :meth:`state_dict`'s; each moves to its layer's device
        and dtype when first added. Parameters already keyed keep their keys (the same model
        going on); a fresh ``ErrorFeedback`` keys a new model's parameters as it meets them."""
        saved_rank, rank = state.get("rank"), _rank()
        if saved_rank is not None and rank is not None and saved_rank != rank:
            raise ValueError(
                f"error feedback: these residuals are rank {saved_rank}'s, loaded on rank "
                f"{rank}; they differ from rank to rank: save each rank's state_dict and load "
                "it on the same rank"
            )
        residuals = state["residuals"]
        if not isinstance(residuals, Mapping) or not all(
            isinstance(r, torch.Tensor) for r in residuals.values()
        ):
            raise TypeError("error feedback state: 'residuals' must map keys to tensors")
        shapes = {int(k): tuple(int(d) for d in v) for k, v in state.get("shapes", {}).items()}
        for k, shape in shapes.items():
            if self._shapes.get(k, shape) != shape:
                raise ValueError(
                    f"error feedback: residual {k} was saved for a parameter of shape {shape}, "
                    f"here it is one of shape {self._shapes[k]}"
                )
        self._shapes.update(shapes)
        self._residuals = {int(k): r.reshape(-1) for k, r in residuals.items()}


def _rank() -> int | None:
    """This process's rank in the default group (None outside torch.distributed): residuals
    are one rank's own."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
