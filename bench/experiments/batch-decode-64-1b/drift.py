"""Does 64-stream decode slow down for bare mlx-lm too, in the same process, after the
engine's tree was filled and cleared? fill.py saw the engine's step drift up (9.1 ms
fresh, 10.2 filled, 10.5 cleared) and not come back when the tree was cleared; this
alternates bare `BatchGenerator` with the engine in each phase, so a drift both share
is the process's (MLX's allocator and buffer cache, the device), one only the engine
shows is ours.

    python bench/experiments/batch-decode-64-1b/drift.py MODEL_DIR [--fill-prompts 48]

Phases, `--repeats` alternating pairs each: fresh; after filling the tree with distinct
2000-token prompts; after `Engine.clear_cache`; after also `mx.clear_cache()` (MLX's
buffer cache emptied). One JSON line per run: its path, step (bench/batch_parity's
measure), MLX active and cached memory, the tree's tokens.
"""

import json
import sys

import mlx.core as mx
from fill import arguments, fill, setup
from mlx_lm import load

from bench.batch_parity import bare, through_engine


def main() -> None:
    args = arguments()
    model, tokenizer = load(str(args.model))
    engine, streams, fillers = setup(args.model, tokenizer.vocab_size, args.fill_prompts)
    paths = {"bare": lambda: bare(model, streams, 128),
             "engine": lambda: through_engine(engine, streams, 128)}

    def measure(phase: str) -> None:
        for repeat in range(args.repeats):
            for name, run in paths.items():
                result = run()
                print(json.dumps({
                    "phase": phase, "repeat": repeat, "path": name,
                    "step_ms": round(result.step_ms(), 2), "tok_s": round(result.tok_s()),
                    "active_gb": round(mx.get_active_memory() / 1e9, 2),
                    "cache_gb": round(mx.get_cache_memory() / 1e9, 2),
                    "tree_tokens": engine.stats().tree.total_tokens}), flush=True)

    try:
        for run in paths.values():
            run()  # compile, warm
        measure("fresh")
        fill(engine, fillers)
        measure("filled")
        engine.clear_cache().result()
        measure("cleared")
        mx.clear_cache()
        measure("buffers freed")
        measure("later")
    finally:
        engine.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
