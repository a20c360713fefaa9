"""Is the slower 64-stream decode after other workloads the radix tree's contents? In one
process (radix-mlx's engine, no HTTP): 64 streams of 64-token prompts, 128 tokens each,
three times on a fresh engine; then the tree filled with ~100k tokens of distinct
2000-token prompts (what the benchmark's earlier workloads leave there), three more; then
the tree cleared (`Engine.clear_cache`), three more.

    python bench/experiments/batch-decode-64-1b/fill.py MODEL_DIR [--fill-prompts 48]

Per run: bench/batch_parity's step (a stream's mean time per token while all decode), the
engine's own mean step (its counters), MLX active memory and the tree's tokens.
"""

import argparse
import asyncio
import json
import random
from pathlib import Path

from mlx_lm import load

from bench.batch_parity import prompts_for, through_engine
from engine.api import SamplingParams
from engine.engine import Engine, EngineConfig


def fill(engine: Engine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> None:
        async for _ in engine.submit(prompt, params):
            pass

    async def all_prompts() -> None:
        await asyncio.gather(*map(one, prompts))

    asyncio.run(all_prompts())


def setup(model: Path, vocab: int, fill_prompts: int
          ) -> tuple[Engine, list[list[int]], list[list[int]]]:
    """A started engine for 64 streams, their 64-token prompts, and `fill_prompts`
    distinct 2000-token prompts to fill its tree with."""
    streams = prompts_for(64, 64, vocab)
    rng = random.Random(0)
    fillers = [[rng.randrange(vocab) for _ in range(2000)] for _ in range(fill_prompts)]
    engine = Engine(EngineConfig(model=str(model), max_batch_size=64, disk_cache_bytes=0))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(f"the engine did not start: {engine.error}")
    return engine, streams, fillers


def arguments() -> argparse.Namespace:
    """MODEL_DIR [--fill-prompts N] [--repeats N], as this folder's scripts take them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--fill-prompts", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    _, tokenizer = load(str(args.model), lazy=True)
    engine, streams, fillers = setup(args.model, tokenizer.vocab_size, args.fill_prompts)

    def measure(phase: str) -> None:
        for repeat in range(args.repeats):
            before = engine.stats().counters
            steps0, seconds0 = before.steps, before.step_seconds
            run = through_engine(engine, streams, 128)
            after = engine.stats()
            steps = after.counters.steps - steps0
            print(json.dumps({
                "phase": phase, "repeat": repeat, "step_ms": round(run.step_ms(), 2),
                "tok_s": round(run.tok_s()),
                "engine_step_ms": round(1e3 * (after.counters.step_seconds - seconds0)
                                        / max(steps, 1), 2),
                "active_gb": round(after.active_memory_bytes / 1e9, 2),
                "tree_tokens": after.tree.total_tokens}), flush=True)

    try:
        through_engine(engine, streams, 128)  # compile, warm
        measure("fresh")
        fill(engine, fillers)
        measure("filled")
        engine.clear_cache().result()
        measure("cleared")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
