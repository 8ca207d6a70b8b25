"""What the framework recipes (lightning_*.py, accelerate_*.py, torchtitan_fsdp.py) report: the
bytes cgx2 sent and each rank's digest of the trained parameters, gathered to rank 0 as JSON."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch.distributed as dist
from torch import nn


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's full value in name order (a DTensor is gathered first):
    ranks that agree on the model have the same digest."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        value = p.detach()
        if hasattr(value, "full_tensor"):  # an FSDP2 shard: every rank takes part
            value = value.full_tensor()
        h.update(name.encode())
        h.update(value.float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def report(path: str | None, model: nn.Module, **fields: object) -> dict | None:
    """Gather ``fields`` and the parameter digest of every rank; rank 0 prints a summary and
    writes ``{"world_size", "ranks": [...]}`` to ``path`` (if given). Call it on every rank."""
    mine = {"rank": dist.get_rank(), "digest": parameter_digest(model), **fields}
    ranks: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() != 0:
        return None
    result = {"world_size": dist.get_world_size(), "ranks": ranks}
    agree = len({r["digest"] for r in ranks}) == 1
    sent = sum(r.get("bytes_sent", 0) for r in ranks)
    plain = sum(r.get("bytes_uncompressed", 0) for r in ranks)
    saved = f", {plain / sent:.1f}x fewer bytes than uncompressed" if sent and plain else ""
    print(f"{len(ranks)} ranks, parameters {'identical' if agree else 'DIFFERENT'}{saved}")
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
    return result
