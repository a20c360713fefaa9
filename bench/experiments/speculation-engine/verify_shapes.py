"""What one verify forward costs on the device against a decode step, by width, the first
time MLX meets its shape and after: the model alone over a batch cache of ROWS rows of
CONTEXT tokens (mlx-lm's BatchKVCache, rows left-padded apart as a serving batch is), fed
(rows, 1 + width) tokens and trimmed back, each shape timed three times in a row.

    python bench/experiments/speculation-engine/verify_shapes.py MODEL_DIR [--rows 16]
        [--context 640] [--widths 0,1,2,3,4,6,8]

Prints one JSON object: per width, milliseconds of each of the three forwards (width 0:
a decode step).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--widths", default="0,1,2,3,4,6,8")
    args = parser.parse_args()
    model, _ = load(args.model)
    paddings = [row % 8 for row in range(args.rows)]
    cache = [BatchKVCache(paddings) for _ in model.layers]
    prompt = mx.random.randint(100, 2000, (args.rows, args.context)).astype(mx.uint32)
    mx.eval(model(prompt, cache=cache))
    result = {"rows": args.rows, "context": args.context, "ms": {}}
    for width in map(int, args.widths.split(",")):
        times = []
        for _ in range(3):
            tokens = mx.random.randint(100, 2000, (args.rows, 1 + width)).astype(mx.uint32)
            mx.eval(tokens)
            started = time.perf_counter()
            logits = model(tokens, cache=cache)
            mx.eval(mx.argmax(logits, axis=-1))
            times.append(round(1000 * (time.perf_counter() - started), 2))
            for layer in cache:
                layer.trim(1 + width)
        result["ms"][width] = times
    print(json.dumps(result))


if __name__ == "__main__":
    main()
