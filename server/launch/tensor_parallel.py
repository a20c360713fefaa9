"""`radix-mlx serve --tensor-parallel N`: launching the ranks, and the run of a rank
other than 0 (engine/distributed.py says how the ranks agree).

Run by a user, the command is the *launcher*: it checks that the model can be sharded
(a one-line error otherwise), then runs `mlx.launch` with this same command line as every
rank: N ranks on 127.0.0.1 (ring backend on the CPU, NCCL on CUDA: mlx.launch's own
choice) or the hosts of `--hostfile`, where ranks on other hosts get our settings'
environment variables from it. Inside the launch (IN_LAUNCH_ENV is set) rank 0 is the
server: HTTP, scheduler, a drain on SIGTERM; the other ranks run the same engine (with
rank 0's engine settings: engine.py) and serve nobody.

Stopping: the launcher sends its first SIGTERM/SIGINT on to the launch's process group,
where only rank 0 acts on it (mlx.launch and the other ranks ignore both, also when a
terminal or a service manager signals them: server/launch/rank_launcher.py): rank 0
drains, then its engine's `Stop` reaches every rank, and all exit 0. A rank that dies
fails the group (rank 0's /health says `failed`, its requests get the reason) and the
launcher exits 1, so that a service manager restarts it. The ring backend notices a lost
peer only when it sends to it: a rank waiting to receive from it spins inside MLX until
the collective timeout. So mlx.launch, which sees the exit at once, tells the others: a
local rank gets SIGUSR1 (server/launch/rank_launcher.py) and fails its engine on it.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from types import FrameType

from mlx._distributed_utils.common import Hostfile

from engine.api import EngineConfig, Lifecycle
from engine.distributed import (
    RankGroup,
    TensorParallelError,
    check_model,
    default_backend,
    join_group,
)
from engine.engine import Engine
from server.config import Settings, env_var
from server.launch.env import IN_LAUNCH_ENV

log = logging.getLogger("radix_mlx.server")

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


def launch_command(settings: Settings, rank_command: list[str],
                   environ: Mapping[str, str] = os.environ) -> list[str]:
    """mlx.launch running `rank_command` as every rank, on this host or the hostfile's.
    Raises TensorParallelError where the hostfile cannot give --tensor-parallel ranks."""
    hosts = (["-n", str(settings.tensor_parallel)] if settings.hostfile is None
             else _hostfile_arguments(settings))
    port = free_ports(settings.tensor_parallel)
    env = [f"{IN_LAUNCH_ENV}=1", *(_settings_env(environ) if settings.hostfile else [])]
    # The interpreter leads the rank's command rather than going in --python, which
    # mlx.launch's mpi backend ignores.
    return [sys.executable, "-m", "server.launch.rank_launcher", *hosts,
            "--starting-port", str(port), "--nccl-port", str(port),
            *(arg for pair in env for arg in ("--env", pair)),
            "--", sys.executable, *rank_command]


def _hostfile_arguments(settings: Settings) -> list[str]:
    """mlx.launch's arguments for the hostfile, whose ranks must be --tensor-parallel.
    Under NCCL mlx.launch gives rank r the GPU r mod -n (its --repeat-hosts, 1 unless
    given), so a host listed k times in a row needs `-n k` for its ranks to get GPUs
    0..k-1 rather than all GPU 0."""
    try:
        hostfile = Hostfile.from_file(settings.hostfile)
    except ValueError as error:  # names the file and what is wrong
        raise TensorParallelError(str(error)) from None
    names = [host.ssh_hostname for host in hostfile.hosts]
    if len(names) != settings.tensor_parallel:
        raise TensorParallelError(
            f"the hostfile {settings.hostfile} lists {len(names)} ranks but "
            f"--tensor-parallel is {settings.tensor_parallel}")
    arguments = ["--hostfile", str(settings.hostfile)]
    if (hostfile.backend or default_backend()) != "nccl":
        return arguments
    runs = [len(list(run)) for _, run in itertools.groupby(names)]
    if len(runs) != len(set(names)) or len(set(runs)) != 1:
        raise TensorParallelError(
            f"the hostfile {settings.hostfile}: under NCCL, mlx.launch gives a host's ranks "
            "their GPUs in turn only if every host is listed the same number of times, "
            "one after another")
    return [*arguments, "-n", str(runs[0])] if runs[0] > 1 else arguments


def _settings_env(environ: Mapping[str, str]) -> list[str]:
    """Our settings' environment variables, for ranks on other hosts, which start from
    their own login environment (mlx.launch exports these on every rank)."""
    names = (env_var(name) for name in Settings.model_fields)
    return [f"{name}={environ[name]}" for name in names if name in environ]


def launch(settings: Settings, model: str) -> int:
    """Start the ranks and wait for them; 0 after a stop we were asked for, else 1."""
    try:
        if os.path.isdir(model):
            check_model(model, settings.tensor_parallel)
        # This same command line, which each rank reads as its own (IN_LAUNCH_ENV set).
        command = launch_command(settings, sys.orig_argv[1:])
    except TensorParallelError as error:
        print(f"radix-mlx serve: {error}", file=sys.stderr)
        return 1
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


def fail_when_a_rank_exits(engine: Engine) -> None:
    """Fail `engine` when mlx.launch says another rank of its group exited (SIGUSR1).

    The handler only sets an event, since it may run in the middle of whatever the main
    thread holds; a thread of its own fails the engine. A rank still loading its model
    has nothing to report: it exits."""
    exited = threading.Event()

    def fail() -> None:
        exited.wait()
        if not engine.served:
            print("radix-mlx serve: another tensor-parallel rank exited while the model "
                  "loaded", file=sys.stderr)
            logging.shutdown()
            os._exit(1)
        engine.give_up("the tensor-parallel group failed: another rank exited")

    signal.signal(signal.SIGUSR1, lambda signum, frame: exited.set())
    threading.Thread(target=fail, name="radix-mlx-rank-exit", daemon=True).start()


def run_rank(config: EngineConfig, group: RankGroup) -> int:
    """A rank other than 0: the same engine as rank 0's, fed by rank 0, until rank 0
    stops it (0) or the group fails (1; the engine exits the process itself then)."""
    for signum in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when to stop
        signal.signal(signum, signal.SIG_IGN)
    engine = Engine(config, group)
    fail_when_a_rank_exits(engine)
    engine.start()
    if engine.wait_ready() is Lifecycle.FAILED:
        print(f"radix-mlx serve: rank {group.rank}: the model failed to load: "
              f"{engine.error}", file=sys.stderr)
        return 1
    engine.wait_stopped()
    return 0
