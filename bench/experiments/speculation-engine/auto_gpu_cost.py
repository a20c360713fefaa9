"""`auto` on one agent-edit stream under the GPU's cost model, in process on any machine:
how many draft tokens it verifies and keeps, beside `off` and `on`. Greedy, EOS kept.

    python bench/experiments/speculation-engine/auto_gpu_cost.py MODEL_DIR [--tokens 300]

On the CPU the engine judges drafts by the CPU's `StepCost`, under which a verify is
cheap; the GPU's asks a verify to keep about 60% of its draft to pay. This runs the CPU
engine with the GPU's constants (not its pipelining), so `auto`'s choices are those a GPU
server makes, at CPU speed. Prints one line per mode.
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


def with_gpu_step_cost() -> None:
    init = generator.Generator.__init__

    def patched(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.step_cost = STEP_COST["gpu"]

    generator.Generator.__init__ = patched


async def main(model: str, tokens: int) -> None:
    engine = Engine(EngineConfig(model=model, speculation=SpeculationConfig("auto")))
    engine.start()
    assert engine.wait_ready(600) == "ready", engine.error
    prompt = agent_edit_prompts(Path(model), 1)[0]
    for mode in ("off", "auto", "on"):
        started, count = time.perf_counter(), 0
        stream = engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                      speculation=mode))
        async for event in stream:
            if isinstance(event, TokenEvent):
                count += 1
            elif isinstance(event, Finish):
                print(f"{mode}: {count} tokens, {count / (time.perf_counter() - started):.1f} "
                      f"tok/s, drafted {event.draft_tokens}, kept "
                      f"{event.accepted_draft_tokens}", flush=True)
        engine.clear_cache().result()  # each mode drafts from the prompt alone
    engine.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args()
    with_gpu_step_cost()
    asyncio.run(main(args.model, args.tokens))
