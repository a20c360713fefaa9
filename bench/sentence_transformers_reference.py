"""sentence-transformers encoding the sentences of a JSON file, in batches, on the device
torch sees (CUDA if any), as its users run it; prints the vectors' .npy path and the
seconds of the measured pass (after a warm-up batch) as JSON.

usage: python -m bench.sentence_transformers_reference MODEL_DIR SENTENCES_JSON BATCH OUT_NPY

Run apart from the bench, without the OpenBLAS preload that MLX's CPU backend is given
(make bench): torch brings its own BLAS, and under that preload ran 5x slower on the
2-core CPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer


def main(model_dir: str, sentences_json: str, batch: str, out: str) -> None:
    sentences = json.loads(Path(sentences_json).read_text())
    size = int(batch)
    batches = [sentences[i:i + size] for i in range(0, len(sentences), size)]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SentenceTransformer(model_dir, device=device)
    model.encode(batches[0], batch_size=size)  # warm-up
    started = time.perf_counter()
    vectors = np.concatenate([model.encode(b, batch_size=size) for b in batches])
    seconds = time.perf_counter() - started
    np.save(out, vectors)
    print(json.dumps({"seconds": seconds, "device": device, "vectors": out}))


if __name__ == "__main__":
    main(*sys.argv[1:])
