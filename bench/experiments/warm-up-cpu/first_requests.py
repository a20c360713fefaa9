"""What the engine's warm-up buys on this machine: the time to ready, then four plain
requests and three JSON-constrained ones, timed one by one, with the warm-up on or off.

    python bench/experiments/warm-up-cpu/first_requests.py MODEL_DIR on|off

Run from the repository root with the CPU environment (`env $(python -m
engine.platform_info)`). Prints one line per figure."""

from __future__ import annotations

import asyncio
import sys
import time

from engine.api import EngineConfig, Finish, SamplingParams
from engine.constraints import json_object
from engine.engine import Engine

PROMPTS = ["Hello there, how are you doing today my friend?",
           "What is the capital of France? Tell me.",
           "Write a JSON object with a name.",
           "Another question about the weather in Paris today."]


async def timed(engine: Engine, text: str, params: SamplingParams) -> float:
    start = time.monotonic()
    async for event in engine.submit(engine.tokenizer.encode(text), params):
        if isinstance(event, Finish):
            break
    return time.monotonic() - start


async def requests(engine: Engine) -> None:
    plain = SamplingParams(max_tokens=8, temperature=0.0)
    for n, text in enumerate(PROMPTS):
        print(f"request {n}: {await timed(engine, text, plain):.2f} s")
    constrained = SamplingParams(max_tokens=12, temperature=0.0, constraint=json_object())
    for n in range(3):
        print(f"constrained {n}: {await timed(engine, PROMPTS[2], constrained):.2f} s")


def main() -> None:
    model, mode = sys.argv[1], sys.argv[2]
    start = time.monotonic()
    engine = Engine(EngineConfig(model=model, warm_up=mode == "on"))
    engine.start()
    engine.wait_ready()
    print(f"ready: {time.monotonic() - start:.2f} s (warm-up {mode})")
    try:
        asyncio.run(requests(engine))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
