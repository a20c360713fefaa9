"""Where a batched verify step's time goes: the engine thread's wall time in each part of
the scheduler's step, with speculation off and on, N streams repeating earlier requests
(the radix tree drafts their first answers). Wraps the generator's and scheduler's
methods with timers, in this process only. Greedy, EOS ignored.

    python bench/experiments/speculation-engine/verify_parts.py MODEL_DIR [--streams 16]
        [--prompt-tokens 512] [--stream-tokens 128] [--agent-edit]

With --agent-edit the streams are bench/speculation.py's agent edit batch, else random
prompts. Either way the passes (off, off, on, on) send the same prompts, so the measured
`on` pass is drafted whole answers by the tree, which holds the earlier passes': its rate
is that of repeated requests, not of the benchmark's new edits (2.4x off in process on an
H200 where the benchmark's new edits ran 1.0-1.17x, bench/results/nvidia-h200/
speculation-smollm2/probes-2026-12-02).

Prints one JSON object: per mode, output tok/s, steps, verify steps, and each part's
milliseconds per step (a part's time includes the parts it calls; `.tolist()` waits for
the device inside whichever part calls it), and the verify steps' own milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import defaultdict
from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_tokenizer

import engine.mlx_lm_internals as internals
from bench.speculation import agent_requests
from bench.workloads import Shapes, TextSource
from engine import generator, scheduler, speculation
from engine.api import EngineConfig, Finish, SamplingParams, TokenEvent
from engine.engine import Engine

TIMES: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
VERIFIES: list[float] = []


def timed(owner: object, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TIMES[label] += time.perf_counter() - started
            CALLS[label] += 1
            if label == "decode.verify":
                VERIFIES.append(time.perf_counter() - started)

    static = isinstance(vars(owner).get(name), staticmethod)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def instrument() -> None:
    timed(scheduler.Scheduler, "_step", "step")
    timed(scheduler.Scheduler, "_take", "step.take (events, tree)")
    timed(generator.Generator, "decode", "decode")
    timed(generator.Generator, "_verify", "decode.verify")
    timed(generator.Generator, "_run", "forward graph")
    timed(generator.Generator, "_sample", "sample")
    timed(generator.Generator, "_roll_back", "verify.roll back")
    timed(speculation.Drafts, "draft", "drafting")
    timed(internals, "drop_last", "roll back.drop_last")
    generator.drop_last = internals.drop_last
    if hasattr(generator, "_agreed"):
        timed(generator, "_agreed", "verify.agreed")


def agent_edit_prompts(model: Path, streams: int) -> list[list[int]]:
    tokenizer = load_tokenizer(model)
    _, requests = agent_requests(TextSource(model, 4000), Shapes(ae_streams=streams))
    return [tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            for messages in requests]


async def one(engine: Engine, prompt: list[int], tokens: int, mode: str) -> int:
    stream = engine.submit(prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                  ignore_eos=True, speculation=mode))
    count = 0
    async for event in stream:
        if isinstance(event, TokenEvent):
            count += 1
        elif isinstance(event, Finish):
            return count
    raise AssertionError("no Finish")


async def measure(args) -> dict:
    rng = random.Random(0)
    engine = Engine(EngineConfig(model=args.model))
    engine.start()
    assert engine.wait_ready(600) == "ready", engine.error
    if args.agent_edit:
        prompts = agent_edit_prompts(Path(args.model), args.streams)
    else:
        prompts = [[rng.randrange(100, 2000) for _ in range(args.prompt_tokens)]
                   for _ in range(args.streams)]
    result: dict = {"args": vars(args)}
    for mode in ("off", "off", "on", "on"):  # the first of each: warm, and into the tree
        TIMES.clear()
        CALLS.clear()
        VERIFIES.clear()
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(engine, p, args.stream_tokens, mode)
                                         for p in prompts))
        wall = time.perf_counter() - started
        steps = CALLS["decode"] or 1
        result[mode] = {"output_tok_s": sum(counts) / wall, "decode steps": steps,
                        "verify steps": CALLS["decode.verify"],
                        "ms per decode step": {k: round(1000 * v / steps, 3)
                                               for k, v in sorted(TIMES.items())},
                        "verify ms": sorted(round(1000 * v, 1) for v in VERIFIES)}
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--agent-edit", action="store_true")
    args = parser.parse_args()
    instrument()
    print(json.dumps(asyncio.run(measure(args)), indent=1))


if __name__ == "__main__":
    main()
