"""`python -m server.launch.rank_launcher MLX_LAUNCH_ARGS`: mlx.launch, as the tensor-parallel
launcher (server/launch/tensor_parallel.py) runs it.

Three changes to its behaviour. Its thread per rank waits in select() for the rank's
output *or for the rank's stdin to be writable*, which a pipe always is: each thread
spins, and on the 2-core CPU machine an all-sum of 64 floats between two ranks took
10 ms under mlx.launch instead of 0.13-0.2 ms. The ranks read nothing from stdin, so
here the threads wait for output only. SIGTERM and SIGINT are ignored, here and (inherited) in the
ranks, which get them from a terminal or a service manager too: the launcher signals
rank 0 alone, which drains and then stops the others (rank 0's server sets handlers of
its own). When a rank exits with an error, mlx.launch stops the others with SIGTERM,
which rank 0 would take for a drain and the others ignore: here a local rank gets SIGUSR1
instead, on which it fails its engine and exits (server/launch/tensor_parallel.py). And if
the launcher that started us dies, even by SIGKILL, the whole launch group is killed, so
no rank outlives it holding the port or the GPU.
"""

import os
import select
import signal
import sys
import threading
import time

from mlx._distributed_utils import launch

ORPHAN_POLL_SECONDS = 1.0
# mlx.launch's own stop of a rank, which `_terminate` ends with.
_mlx_terminate = launch.RemoteProcess.terminate


def _select_without_stdin(rlist: list, wlist: list, xlist: list, timeout: float
                          ) -> tuple[list, list, list]:
    return select.select(rlist, [], xlist, timeout)


def _terminate(command: launch.RemoteProcess) -> None:
    """mlx.launch's stop of a rank after another one exited: SIGUSR1 to a local rank
    (the launch script execs it, so the process is the rank) and a wait for its exit,
    then mlx.launch's own stop, which a remote rank still needs."""
    if command._is_local and command.process.poll() is None:
        command.process.send_signal(signal.SIGUSR1)
        command.process.wait()
    _mlx_terminate(command)


def _die_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_SECONDS)
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_die_with, args=(os.getppid(),), daemon=True).start()
    launch.select = _select_without_stdin
    launch.RemoteProcess.terminate = _terminate
    sys.argv[0] = "mlx.launch"
    launch.main()
