"""Classify passes against a running server: MODEL URL PASSES FIRST_SEED CONCURRENCY [BATCH].
Prints the sentences/s of each pass (its workload built once, then kept in /tmp)."""
import asyncio, pickle, sys
from pathlib import Path
H100_SHAPE = {"cl_sentences": 512, "cl_batch": 64, "cl_preamble_tokens": 48, "cl_sentence_tokens": 16}
from bench.client import run_batches
from bench.workloads import Shapes, TextSource, classify
model, url, passes, first, conc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
batch = int(sys.argv[6]) if len(sys.argv) > 6 else 64
shape = {**H100_SHAPE, "cl_sentences": 4096, "cl_concurrency": conc, "cl_batch": batch}
def work(seed):
    cached = Path(f"/tmp/drive-{seed}-{conc}-{batch}.pkl")
    if cached.exists():
        return pickle.loads(cached.read_bytes())
    w = classify(TextSource(model, seed), Shapes(**shape))
    cached.write_bytes(pickle.dumps(w))
    return w
works = [work(first + i) for i in range(passes)]
rates = []
for w in works:
    run = asyncio.run(run_batches(url, w, {}))
    errors = [r.error for r in run.requests if r.error]
    rates.append(len(run.requests) / run.wall_seconds)
    if errors: print("errors", len(errors), errors[:1])
print(f"conc {conc} batch {batch}: " + " ".join(f"{r:.0f}" for r in rates), flush=True)
