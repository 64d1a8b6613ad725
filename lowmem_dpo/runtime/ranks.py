"""Which process this is, from the launcher's environment: the ground floor under errors.log (rank 0 alone
logs) and distributed.py (the process group). Pure reads of os.environ, no imports of the package."""

from __future__ import annotations

import os
from dataclasses import dataclass

# Where launchers put (rank, world size, local rank): torchrun and accelerate launch on GPUs; then MPI, which
# `accelerate launch --cpu --mpirun_hostfile` uses to start several CPU processes (OpenMPI, then Intel MPI / MPICH).
ENV_NAMES = (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
             ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
             ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))
# Processes on this machine (torchrun, OpenMPI): they share its RAM.
LOCAL_SIZE_NAMES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class World:
    rank: int = 0  # this process among all
    size: int = 1  # processes in the run
    local_rank: int = 0  # this process among those on its machine: its GPU

    @property
    def main(self) -> bool:  # rank 0 logs, writes the files and checkpoints
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's place, from the launcher's environment (one process without it)."""
    env = os.environ
    for rank, size, local in ENV_NAMES:
        if size in env:
            return World(int(env.get(rank, 0)), int(env[size]), int(env.get(local, 0)))
    return World()


def local_size() -> int:
    """Processes of the run on this machine (1 without a launcher)."""
    for name in LOCAL_SIZE_NAMES:
        if name in os.environ:
            return int(os.environ[name])
    return world().size
