"""Shared-prefix throughput at --kv-bits 8 and 4 against unquantized, in one process:
three engines on the same model, their rounds alternating, so the 2-core machine's load
(other jobs) weighs on each alike. A round: 8 chats behind one cached 1000-token system
prompt, submitted together, 32 greedy tokens each; output tokens over its wall time.

    python bench/experiments/kv-quant-ab/ab.py MODEL_DIR [ROUNDS]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

from engine.api import EngineConfig, SamplingParams
from engine.engine import Engine

ROWS, SYSTEM_TOKENS, QUESTION_TOKENS, OUTPUT_TOKENS = 8, 1000, 30, 32


async def round_of(engine: Engine, prompts: list[list[int]]) -> float:
    async def one(prompt: list[int]) -> int:
        stream = engine.submit(prompt, SamplingParams(max_tokens=OUTPUT_TOKENS,
                                                      temperature=0.0, ignore_eos=True))
        return len([event async for event in stream if hasattr(event, "token")])

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens / (time.perf_counter() - started)


async def main(model: str, rounds: int) -> None:
    engines = {}
    for bits in (None, 8, 4):
        engine = Engine(EngineConfig(model=model, kv_bits=bits, cache_bytes=1 << 30))
        engine.start()
        assert engine.wait_ready(300) == "ready", engine.error
        engines[bits] = engine
    vocab = engines[None]._loaded.vocab_size
    system = [(7 * i) % (vocab - 100) + 50 for i in range(SYSTEM_TOKENS)]
    prompts = [system + [(13 * i + r) % (vocab - 100) + 50 for i in range(QUESTION_TOKENS)]
               for r in range(ROWS)]
    for engine in engines.values():  # caches the system prompt; the rounds then hit it
        await round_of(engine, prompts)
    rates: dict = {bits: [] for bits in engines}
    for _ in range(rounds):
        for bits, engine in engines.items():
            rates[bits].append(await round_of(engine, prompts))
            print(f"kv_bits {bits}: {rates[bits][-1]:.2f} tok/s", file=sys.stderr, flush=True)
    medians = {bits: statistics.median(r) for bits, r in rates.items()}
    print(json.dumps({"rounds": {str(b): r for b, r in rates.items()},
                      "median_tok_s": {str(b): m for b, m in medians.items()},
                      "ratio_vs_unquantized": {str(b): medians[b] / medians[None]
                                               for b in (8, 4)}}, indent=2))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5))
