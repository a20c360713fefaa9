"""Where a repeated 64-chat batch's host time goes: py-spy on a radix-mlx server while
the batch_decode workload runs again (the same chats, so every prompt and every reply's
next turn is cached).

    python bench/experiments/batch-decode-64-1b/profile_repeat.py MODEL_DIR URL PID OUT

The server (PID, at URL) gets the benchmark's warm-up, then three rounds of: the
workload once, five idle seconds, py-spy recording for three seconds (`--threads`, raw
stacks to OUT/spyN.txt; round 1 with `--native`, MLX's C++ frames too) while the workload
runs again. Prints each profiled run's output tok/s, TTFT p50 and wall time. Run the
server with `--log-level debug` to match its step lines against the profiles.
"""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from sequence import GPU_SIZES

from bench import report
from bench.client import run_workload
from bench.servers import RADIX
from bench.workloads import build_all, build_warm_up


def main() -> None:
    model, url, pid, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
    workload = {w.name: w for w in build_all(model, GPU_SIZES, 0)}["batch_decode"]
    asyncio.run(run_workload(url, build_warm_up(model, GPU_SIZES, 0), RADIX.extra))
    for index, extra in enumerate(([], ["--native"], [])):
        asyncio.run(run_workload(url, workload, RADIX.extra))
        time.sleep(5)
        spy = subprocess.Popen(["py-spy", "record", "--pid", pid, "--rate", "250",
                                "--threads", "--format", "raw", "--output",
                                str(out / f"spy{index}.txt"), "--duration", "3", *extra])
        time.sleep(0.5)
        summary = report.summarize(asyncio.run(run_workload(url, workload, RADIX.extra)),
                                   0, None)
        print(json.dumps({k: summary[k] for k in ("output_tok_s", "ttft_p50",
                                                  "wall_seconds")}), flush=True)
        spy.wait()


if __name__ == "__main__":
    main()
