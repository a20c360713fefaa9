"""Send the benchmark's classify lists (H100 sizes: 512 sentences in lists of 64, one
list after another) to a running server PASSES times, each pass new text (seeds FIRST,
FIRST + 1, ...: a preamble and sentences the server has not cached, as in a benchmark
round); print sentences/s of each pass.

    python drive.py MODEL_DIR BASE_URL PASSES FIRST
"""

import asyncio
import sys
from pathlib import Path

from bench.classify_trace import H100_SHAPE
from bench.client import run_batches
from bench.workloads import Shapes, build_all


def main() -> None:
    model, base_url = Path(sys.argv[1]), sys.argv[2]
    passes, first = int(sys.argv[3]), int(sys.argv[4])
    for i in range(passes):
        workload = next(w for w in build_all(model, Shapes(**H100_SHAPE), first + i)
                        if w.name == "classify")
        run = asyncio.run(run_batches(base_url, workload, {}))
        failed = sum(r.error is not None for r in run.requests)
        print(f"pass {i}: {len(run.requests) / run.wall_seconds:.0f} sentences/s, {failed} failed",
              flush=True)


if __name__ == "__main__":
    main()
