"""What a tensor-parallel launch tells each rank through its environment, readable
without MLX (the log format reads it before anything else is imported)."""

from __future__ import annotations

import os

# Set through mlx.launch's --env in every rank's environment, whichever backend starts it
# (mlx.launch sets MLX_RANK for its own; mpirun, the hostfile's "mpi" backend, does not).
IN_LAUNCH_ENV = "RADIX_MLX_IN_LAUNCH"


def in_launch() -> bool:
    """This process is a rank of a launch (server/launch/tensor_parallel.py), not its launcher."""
    return IN_LAUNCH_ENV in os.environ


def launch_rank() -> str:
    """This rank's number as its launcher gave it (for log lines, before it joins)."""
    return os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK", "?")
