"""`auto` on agent-edit streams under the GPU's cost model and pipelining, in process on
any machine: how many draft tokens it verifies and keeps, beside `off` and `on`. Greedy,
EOS kept.

    python bench/experiments/speculation-engine/auto_gpu_cost.py MODEL_DIR \
        [--streams 16] [--tokens 96] [--modes off,auto,on]

On the CPU the engine judges drafts by the CPU's `StepCost`, under which a verify is
cheap, and decodes unpipelined; the GPU's cost asks a verify to keep about 60% of its
draft to pay, and a pipelined look drafts past the token still being computed. This runs
the CPU engine with the GPU's constants and pipelining, so `auto`'s choices are those a
GPU server makes, at CPU speed (its times are the CPU's). Prints one line per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from verify_parts import agent_edit_prompts

from engine import generator
from engine.api import EngineConfig, Finish, SamplingParams, SpeculationConfig, TokenEvent
from engine.engine import Engine
from engine.speculation import STEP_COST


def as_on_a_gpu() -> None:
    init = generator.Generator.__init__

    def patched(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.step_cost, self.pipelined = STEP_COST["gpu"], True

    generator.Generator.__init__ = patched


async def answer(engine: Engine, prompt: list[int], mode: str, tokens: int
                 ) -> tuple[int, int, int]:
    """Tokens out, drafted and kept."""
    count = 0
    stream = engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                  speculation=mode))
    async for event in stream:
        if isinstance(event, TokenEvent):
            count += 1
        elif isinstance(event, Finish):
            return count, event.draft_tokens, event.accepted_draft_tokens
    raise RuntimeError("the stream ended without a finish")


async def main(model: str, streams: int, tokens: int, modes: list[str]) -> None:
    engine = Engine(EngineConfig(model=model, speculation=SpeculationConfig("auto")))
    engine.start()
    assert engine.wait_ready(600) == "ready", engine.error
    prompts = agent_edit_prompts(Path(model), streams)
    for mode in modes:
        started = time.perf_counter()
        results = await asyncio.gather(*(answer(engine, p, mode, tokens) for p in prompts))
        elapsed = time.perf_counter() - started
        out, drafted, kept = (sum(column) for column in zip(*results))
        print(f"{mode}: {streams} streams, {out} tokens, {out / elapsed:.1f} tok/s (CPU), "
              f"drafted {drafted}, kept {kept}", flush=True)
        engine.clear_cache().result()  # each mode drafts from the prompts alone
    engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--modes", default="off,auto,on")
    args = parser.parse_args()
    as_on_a_gpu()
    asyncio.run(main(args.model, args.streams, args.tokens, args.modes.split(",")))
