"""Classify passes against a running server: MODEL URL PASSES FIRST_SEED CONCURRENCY [BATCH].

Prints the sentences/s of each pass. Each pass's workload (4096 sentences in lists of
BATCH, the H100 shape of bench.classify_trace) is built once and kept in /tmp: building
one takes seconds, which a device lease pays for every server variant otherwise.
"""

import asyncio
import pickle
import sys
from pathlib import Path

from bench.client import run_batches
from bench.workloads import Shapes, TextSource, Workload, classify

SHAPE = {"cl_sentences": 4096, "cl_preamble_tokens": 48, "cl_sentence_tokens": 16}


def workload(model: Path, seed: int, concurrency: int, batch: int) -> Workload:
    kept = Path(f"/tmp/drive-{seed}-{concurrency}-{batch}.pkl")
    if kept.exists():
        return pickle.loads(kept.read_bytes())
    built = classify(TextSource(model, seed),
                     Shapes(**SHAPE, cl_concurrency=concurrency, cl_batch=batch))
    kept.write_bytes(pickle.dumps(built))
    return built


def main() -> None:
    model, url = Path(sys.argv[1]), sys.argv[2]
    passes, first, concurrency = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 64
    rates = []
    for seed in range(first, first + passes):
        run = asyncio.run(run_batches(url, workload(model, seed, concurrency, batch), {}))
        errors = [r.error for r in run.requests if r.error]
        if errors:
            print("errors", len(errors), errors[:1])
        rates.append(len(run.requests) / run.wall_seconds)
    print(f"conc {concurrency} batch {batch}: " + " ".join(f"{r:.0f}" for r in rates),
          flush=True)


if __name__ == "__main__":
    main()
