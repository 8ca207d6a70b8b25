"""Error feedback: what a rank's quantization took from a gradient, added back at the next step;
residuals are kept per parameter, survive DDP's bucket rebuild and go into checkpoints."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

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
    had. Parameters are held weakly.
    """

    def __init__(self) -> None:
        self._keys: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._next_key = 0
        self._residuals: dict[int, torch.Tensor] = {}

    def key(self, param: torch.Tensor) -> int:
        """``param``'s stable key (a new one the first time it is seen)."""
        key = self._keys.get(param)
        if key is None:
            key = self._keys[param] = self._next_key
            self._next_key += 1
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

    def update_(self, key: int, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep ``sent − decoded`` (computed in fp32, stored in ``sent``'s dtype)."""
        error = sent.reshape(-1).float() - decoded.reshape(-1).float()
        self._residuals[key] = error.to(sent.dtype)

    def store_(self, key: int, residual: torch.Tensor) -> None:
        """Keep ``residual`` itself (not copied: the caller hands over a fresh tensor)."""
        self._residuals[key] = residual.reshape(-1)

    def discard_(self, key: int) -> None:
        """Forget ``key``'s residual (its layer was reduced exactly: nothing is owed)."""
        self._residuals.pop(key, None)

    def state_dict(self) -> dict[str, object]:
        """The residuals by key (copies, on their devices)."""
        return {"residuals": {k: r.detach().clone() for k, r in self._residuals.items()}}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Replace the residuals with :meth:`state_dict`'s; each moves to its layer's device
        and dtype when first added. Parameters already keyed keep their keys (the same model
        going on); a fresh ``ErrorFeedback`` keys a new model's parameters as it meets them."""
        residuals = state["residuals"]
        if not isinstance(residuals, Mapping) or not all(
            isinstance(r, torch.Tensor) for r in residuals.values()
        ):
            raise TypeError("error feedback state: 'residuals' must map keys to tensors")
        self._residuals = {int(k): r.reshape(-1) for k, r in residuals.items()}
