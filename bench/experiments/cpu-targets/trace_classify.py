"""The classify workload in-process: every model call's input shape, the scheduler's
counters, wall and process CPU time (a measurement script for this folder's README).

    LD_PRELOAD=.../libblas.so.3 python trace_classify.py MODEL_DIR [config_field=int ...]

One untimed list first, then the tree is cleared and the workload's lists run one after
another, as the benchmark's client sends them. Prints one JSON object.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

from bench.workloads import Shapes, build_all
from engine.api import EngineConfig, Finish, SamplingParams
from engine.engine import Engine

model = Path(sys.argv[1])
overrides = {key: int(value) for key, value in (arg.split("=") for arg in sys.argv[2:])}
workload = next(w for w in build_all(model, Shapes(), 0) if w.name == "classify")
engine = Engine(EngineConfig(model=str(model), disk_cache_bytes=0, **overrides))
engine.start()
engine.wait_ready()
scheduler = engine._scheduler
calls: list[tuple[int, ...]] = []
inner = scheduler.generator.model


class Counting:
    """The model, recording each call's input shape (rows, tokens)."""

    def __call__(self, inputs, cache=None):
        calls.append(tuple(inputs.shape))
        return inner(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(inner, name)


scheduler.generator.model = Counting()
texts = [c.user_turns[0] for c in workload.conversations]


async def one_list(batch: list[str]) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    streams = [engine.submit(engine.tokenizer.encode(text), params) for text in batch]
    for stream in streams:
        async for event in stream:
            if isinstance(event, Finish):
                break


async def main() -> None:
    await one_list(texts[:workload.batch])
    scheduler.tree.clear()
    before = dict(vars(scheduler.counters))
    calls.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(texts), workload.batch):
        await one_list(texts[i:i + workload.batch])
    wall = time.perf_counter() - wall
    after = vars(scheduler.counters)
    print(json.dumps({
        "sentences": len(texts), "wall_s": wall, "sentences_s": len(texts) / wall,
        "process_cpu_s": time.process_time() - cpu, "forwards": len(calls),
        "forward_shapes": calls, "counters": {k: after[k] - before[k] for k in before}}))


asyncio.run(main())
