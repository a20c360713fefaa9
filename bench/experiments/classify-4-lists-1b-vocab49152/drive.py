"""Send the benchmark's classify lists (lists of 64 one-line sentences behind a 48-token
instruction) to a running server, LISTS of them in flight at once, PASSES passes of
SENTENCES sentences, each pass new text (seeds FIRST, FIRST + 1, ...); print sentences/s
of each pass.

    python drive.py MODEL_DIR BASE_URL PASSES FIRST LISTS SENTENCES
"""

import asyncio
import sys
from pathlib import Path

from bench.classify_trace import H100_SHAPE
from bench.client import run_batches
from bench.workloads import Shapes, build_all


def main() -> None:
    model, base_url = Path(sys.argv[1]), sys.argv[2]
    passes, first, lists, sentences = map(int, sys.argv[3:7])
    shape = Shapes(**dict(H100_SHAPE, cl_concurrency=lists, cl_sentences=sentences))
    for i in range(passes):
        workload = next(w for w in build_all(model, shape, first + i) if w.name == "classify")
        run = asyncio.run(run_batches(base_url, workload, {}))
        failed = sum(r.error is not None for r in run.requests)
        print(f"pass {i}: {len(run.requests) / run.wall_seconds:.0f} sentences/s, {failed} failed",
              flush=True)


if __name__ == "__main__":
    main()
