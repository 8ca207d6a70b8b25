"""Launchers: make ``mpirun -np N python train.py`` look like ``torchrun`` to ``env://``.

Under Open MPI (or MPICH/Hydra), ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
and a ``MASTER_ADDR``/``MASTER_PORT`` are set from the MPI variables, where the user has not.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import MutableMapping
from typing import NamedTuple

__all__ = ["setup_mpi_env"]

log = logging.getLogger("cgx2")


class _Variables(NamedTuple):
    """The variables in which an MPI launcher says where a process runs."""

    size: str
    rank: str
    local_rank: str
    local_size: str


_LAUNCHERS = {
    "Open MPI": _Variables(
        size="OMPI_COMM_WORLD_SIZE",
        rank="OMPI_COMM_WORLD_RANK",
        local_rank="OMPI_COMM_WORLD_LOCAL_RANK",
        local_size="OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "MPICH": _Variables(
        size="PMI_SIZE", rank="PMI_RANK", local_rank="MPI_LOCALRANKID", local_size="MPI_LOCALNRANKS"
    ),
}
DEFAULT_PORT = 29500


def setup_mpi_env(environ: MutableMapping[str, str] | None = None) -> bool:
    """Fill in torch's ``env://`` variables from an MPI launcher's; return whether one was
    found. Variables already set are kept. Across several nodes ``MASTER_ADDR`` cannot be
    guessed, so a ``RuntimeError`` asks for it."""
    env = os.environ if environ is None else environ
    found = [(n, v) for n, v in _LAUNCHERS.items() if v.size in env and v.rank in env]
    if not found:
        return False
    name, (size_var, rank_var, local_rank_var, local_size_var) = found[0]
    size, rank = env[size_var], env[rank_var]
    local_size = env.get(local_size_var, size)
    env.setdefault("WORLD_SIZE", size)
    env.setdefault("RANK", rank)
    env.setdefault("LOCAL_RANK", env.get(local_rank_var, rank))
    env.setdefault("LOCAL_WORLD_SIZE", local_size)
    if "MASTER_ADDR" not in env:
        if local_size != size:
            raise RuntimeError(
                f"{name} launched {size} ranks over several nodes; set MASTER_ADDR to the "
                "host of rank 0 (e.g. mpirun -x MASTER_ADDR=node0 ...)"
            )
        env["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in env:
        # The same on every rank of one job, different between jobs on one host.
        job = env.get("OMPI_MCA_ess_base_jobid", "")
        env["MASTER_PORT"] = str(DEFAULT_PORT + (zlib.crc32(job.encode()) % 1000 if job else 0))
    log.info(
        "%s: rank %s of %s, master %s:%s",
        name,
        env["RANK"],
        env["WORLD_SIZE"],
        env["MASTER_ADDR"],
        env["MASTER_PORT"],
    )
    return True
