"""Send the benchmark's classify lists (H100 sizes: 512 sentences in lists of 64, one
list after another) to a running server PASSES times, each pass new text (seeds FIRST,
FIRST + 1, ...: a preamble and sentences the server has not cached, as in a benchmark
round); print sentences/s of each pass. LISTS in flight at once and SENTENCES a pass
where given (classify-4-lists-1b-vocab49152).

    python drive.py MODEL_DIR BASE_URL PASSES FIRST [LISTS SENTENCES]
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
    shape = dict(H100_SHAPE)
    if len(sys.argv) > 5:
        shape |= {"cl_concurrency": int(sys.argv[5]), "cl_sentences": int(sys.argv[6])}
    for i in range(passes):
        workload = next(w for w in build_all(model, Shapes(**shape), first + i)
                        if w.name == "classify")
        run = asyncio.run(run_batches(base_url, workload, {}))
        failed = sum(r.error is not None for r in run.requests)
        print(f"pass {i}: {len(run.requests) / run.wall_seconds:.0f} sentences/s, {failed} failed",
              flush=True)


if __name__ == "__main__":
    main()
