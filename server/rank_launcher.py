"""`python -m server.rank_launcher MLX_LAUNCH_ARGS`: mlx.launch, as the tensor-parallel
launcher (server/tensor_parallel.py) runs it.

Two changes to its behaviour. SIGTERM and SIGINT are ignored, here and (inherited) in the
ranks, which get them from a terminal or a service manager too: the launcher signals
rank 0 alone, which drains and then stops the others (rank 0's server sets handlers of
its own). And if the launcher that started us dies, even by SIGKILL, the whole launch
group is killed, so no rank outlives it holding the port or the GPU.
"""

import os
import signal
import sys
import threading
import time

from mlx._distributed_utils.launch import main

ORPHAN_POLL_SECONDS = 1.0


def _die_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_SECONDS)
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_die_with, args=(os.getppid(),), daemon=True).start()
    sys.argv[0] = "mlx.launch"
    main()
