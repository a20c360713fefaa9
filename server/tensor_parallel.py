"""`radix-mlx serve --tensor-parallel N`: launching the ranks, and the run of a rank
other than 0 (engine/distributed.py says how the ranks agree).

Run by a user, the command is the *launcher*: it checks that the model can be sharded
(a one-line error otherwise), then runs `mlx.launch` with this same command line as every
rank: N ranks on 127.0.0.1 (ring backend on the CPU, NCCL on CUDA: mlx.launch's own
choice) or the hosts of `--hostfile`. Inside the launch (MLX_RANK is set) rank 0 is the
server: HTTP, scheduler, a drain on SIGTERM; the other ranks run the same engine and
serve nobody.

Stopping: the launcher sends its first SIGTERM/SIGINT on to the launch's process group,
where only rank 0 acts on it (mlx.launch and the other ranks ignore both, also when a
terminal or a service manager signals them: server/rank_launcher.py): rank 0 drains, then its engine's `Stop` reaches every
rank, and all exit 0. A rank that dies fails the group (rank 0's /health says `failed`,
its requests get the reason); mlx.launch then stops the rest, and the launcher exits 1 so
that a service manager restarts it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from types import FrameType

from engine.api import EngineConfig, Lifecycle
from engine.distributed import RankGroup, TensorParallelError, check_model, join_group
from engine.engine import Engine
from server.config import Settings

log = logging.getLogger("radix_mlx.server")

RANK_ENV = "MLX_RANK"  # set by mlx.launch in every rank's environment
def in_launch() -> bool:
    return RANK_ENV in os.environ


def join(settings: Settings) -> RankGroup | None:
    """This process's rank, or None after printing why it has none."""
    try:
        return join_group(settings.tensor_parallel)
    except (TensorParallelError, RuntimeError) as error:  # RuntimeError: MLX's own
        print(f"radix-mlx serve: tensor parallel: {error}", file=sys.stderr)
        return None


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1 (the ring backend's
    listeners, one per rank)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            sockets = []
            for port in range(first, first + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()


def launch_command(settings: Settings, rank_command: list[str]) -> list[str]:
    """mlx.launch running `rank_command` as every rank."""
    hosts = (["--hostfile", str(settings.hostfile)] if settings.hostfile is not None
             else ["-n", str(settings.tensor_parallel)])
    port = free_ports(settings.tensor_parallel)
    return [sys.executable, "-m", "server.rank_launcher", *hosts, "--starting-port", str(port),
            "--nccl-port", str(port), "--python", sys.executable, "--", *rank_command]


def launch(settings: Settings, model: str) -> int:
    """Start the ranks and wait for them; 0 after a stop we were asked for, else 1."""
    try:
        if os.path.isdir(model):
            check_model(model, settings.tensor_parallel)
    except TensorParallelError as error:
        print(f"radix-mlx serve: {error}", file=sys.stderr)
        return 1
    # This same command line, which each rank reads as its own (MLX_RANK set).
    command = launch_command(settings, sys.orig_argv[1:])
    log.info("tensor parallel: %d ranks through mlx.launch", settings.tensor_parallel)
    # A pipe nobody writes: mlx.launch forwards stdin to the ranks and would spin on an
    # always-readable /dev/null.
    process = subprocess.Popen(command, stdin=subprocess.PIPE, process_group=0)
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        # The whole group: mlx.launch and ranks other than 0 ignore it, rank 0 drains.
        # A second signal kills everything at once.
        os.killpg(process.pid, signal.SIGKILL if stopping else signal.SIGTERM)
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    process.wait()
    if stopping:
        return 0
    print("radix-mlx serve: a tensor-parallel rank stopped, and with it the server "
          "(see its log above)", file=sys.stderr)
    return 1


def run_rank(config: EngineConfig, group: RankGroup) -> int:
    """A rank other than 0: the same engine as rank 0's, fed by rank 0, until rank 0
    stops it (0) or the group fails (1; the engine exits the process itself then)."""
    for signum in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop
        signal.signal(signum, signal.SIG_IGN)
    engine = Engine(config, group)
    engine.start()
    if engine.wait_ready() is Lifecycle.FAILED:
        print(f"radix-mlx serve: rank {group.rank}: the model failed to load: "
              f"{engine.error}", file=sys.stderr)
        return 1
    engine.wait_stopped()
    return 0
