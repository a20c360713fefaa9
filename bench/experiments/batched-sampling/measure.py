"""Decode steps of sampled and penalized rows against greedy ones, the engine in process:
64 streams of random token prompts, each variant's median time per token once every
stream decodes (medians over alternating rounds).

    python bench/experiments/batched-sampling/measure.py MODEL_DIR [STREAMS] [TOKENS] [ROUNDS]

Run it from the commit to measure; PYTHONPATH=DIR picks another tree's `engine` (the
"before" of a change) with this file.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys
import time

from engine.api import SamplingParams, TokenEvent
from engine.engine import Engine, EngineConfig

VARIANTS = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "half greedy, half temperature 1": None,  # row parity picks
    "frequency_penalty 0.5": {"temperature": 0.0, "frequency_penalty": 0.5},
    "repetition_penalty 1.1": {"temperature": 0.0, "repetition_penalty": 1.1},
    "logit_bias": {"temperature": 0.0, "logit_bias": {5: 1.0}},
}


def prompts(streams: int) -> list[list[int]]:
    return [[(7 * i + 13 * s + 11) % 2000 + 100 for i in range(16)] for s in range(streams)]


def step_ms(engine: Engine, variant: str, streams: int, tokens: int) -> float:
    def params(row: int) -> SamplingParams:
        options = VARIANTS[variant] or {"temperature": float(row % 2)}
        return SamplingParams(max_tokens=tokens, ignore_eos=True, **options)

    async def read(row: int, prompt: list[int]) -> list[float]:
        return [time.perf_counter() async for event in engine.submit(prompt, params(row))
                if isinstance(event, TokenEvent)]

    async def run() -> list[list[float]]:
        return await asyncio.gather(*(read(i, p) for i, p in enumerate(prompts(streams))))

    times = asyncio.run(run())
    decoding = max(t[1] for t in times)  # every stream past its first token
    gaps = [b - a for t in times for a, b in itertools.pairwise(t) if a >= decoding]
    return statistics.median(gaps) * 1e3


def main() -> None:
    model = sys.argv[1]
    streams, tokens, rounds = ([int(a) for a in sys.argv[2:5]] + [64, 128, 3][len(sys.argv) - 2:])[:3]
    engine = Engine(EngineConfig(model=model, max_batch_size=streams, disk_cache_bytes=0))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(f"the engine did not start: {engine.error}")
    for variant in VARIANTS:  # first shapes compiled
        step_ms(engine, variant, streams, tokens)
    found = {variant: [] for variant in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            found[variant].append(round(step_ms(engine, variant, streams, tokens), 2))
    engine.shutdown()
    print(json.dumps({"streams": streams, "tokens": tokens,
                      "step_ms": {v: statistics.median(r) for v, r in found.items()},
                      "rounds": found}))


if __name__ == "__main__":
    main()
