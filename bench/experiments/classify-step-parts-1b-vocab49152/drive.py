"""The benchmark's classify passes from workloads built once, so that every server of a
comparison gets the same text and no pass waits for a workload to be built.

    python drive.py build MODEL_DIR FILE      # a warm-up workload and three passes, pickled
    python drive.py run FILE BASE_URL LISTS   # each pass through a server, LISTS in flight
"""

import asyncio
import pickle
import sys
from dataclasses import replace
from pathlib import Path

from bench.classify_trace import H100_SHAPE
from bench.client import run_batches
from bench.workloads import Shapes, build_all

SEEDS = (100, 200, 201, 202)  # the first is the warm-up pass


def main() -> None:
    if sys.argv[1] == "build":
        shapes = Shapes(**dict(H100_SHAPE, cl_concurrency=4, cl_sentences=4096))
        workloads = [next(w for w in build_all(Path(sys.argv[2]), shapes, seed)
                          if w.name == "classify") for seed in SEEDS]
        Path(sys.argv[3]).write_bytes(pickle.dumps(workloads))
        return
    workloads = pickle.loads(Path(sys.argv[2]).read_bytes())
    base_url, lists = sys.argv[3], int(sys.argv[4])
    for i, workload in enumerate(workloads):
        run = asyncio.run(run_batches(base_url, replace(workload, concurrency=lists), {}))
        failed = sum(r.error is not None for r in run.requests)
        print(f"{'warm' if i == 0 else 'pass'} {i}: "
              f"{len(run.requests) / run.wall_seconds:.0f} sentences/s, {failed} failed",
              flush=True)


if __name__ == "__main__":
    main()
