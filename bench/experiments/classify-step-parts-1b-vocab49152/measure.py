"""Where a classify step's time goes, in process: the read forward's graph building, its
evaluation and read-back, the per-row work after it, and the engine's idle time between
steps; and how a read forward's time grows with its rows.

    python bench/experiments/classify-step-parts/measure.py MODEL_DIR [--sentences 4096]

Scenarios, each on the benchmark's classify text (lists of 64, a 48-token preamble,
16-token sentences), after an untimed list:
- `one_at_a_time`: a list, its 64 readings, then the next (bench.classify_trace's run);
- `four_clients`: four tasks each sending its next list once its last one is read (the
  benchmark's `--cl-concurrency 4`, without HTTP);
- `forward_rows`: `Generator.read_together` alone over the cached preamble for 64, 128,
  256 and 512 rows, synchronized, median of 10 (ms).
Timers wrap the engine's methods from here; nothing in the engine changes. (Parts that
exist from the queued read on, `readings` and `land`, are timed where they exist.)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from bench.classify_trace import H100_SHAPE
from bench.workloads import Shapes, build_all
from engine import generator as generator_module
from engine.api import EngineConfig, Finish, Prompt, Readout, SamplingParams
from engine.engine import Engine
from engine.generator import segment_spans
from engine.scheduler import Scheduler
from server.prefill.jobs import shared_prefix


class Timeline:
    """Seconds spent per part, and counts, while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: collections.Counter[str] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()
        self.last_step_end: float | None = None

    def add(self, part: str, seconds: float, count: int = 1) -> None:
        if self.on:
            self.seconds[part] += seconds
            self.counts[part] += count

    def report(self, sentences: int, wall: float) -> dict:
        return {"sentences_s": round(sentences / wall, 1),
                "ms_per_list_of_64": {k: round(1000 * v / sentences * 64, 3)
                                      for k, v in self.seconds.most_common()},
                "counts_per_list": {k: round(v / sentences * 64, 3)
                                    for k, v in self.counts.items()},
                "wall_ms_per_list": round(1000 * wall / sentences * 64, 3)}


def instrument(timeline: Timeline) -> None:
    step, read = Scheduler._step, Scheduler._read
    read_together = generator_module.Generator.read_together
    readings = getattr(generator_module, "QueuedReads", None)
    land = getattr(Scheduler, "_land", None)

    def timed(function, part, rows=None):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                timeline.add(part, time.perf_counter() - start)
                if rows is not None:
                    timeline.add(rows, 0.0, len(args[2]))
        return wrapper

    def timed_step(self, *args, **kwargs):
        start = time.perf_counter()
        if timeline.last_step_end is not None:
            timeline.add("between_steps", start - timeline.last_step_end)
        try:
            return step(self, *args, **kwargs)
        finally:
            timeline.last_step_end = time.perf_counter()
            timeline.add("step", timeline.last_step_end - start)

    Scheduler._step = timed_step
    Scheduler._read = timed(read, "read")
    # Queued (this commit on): building and queuing the forward, then waiting for and
    # reading back its values; before, read_together did both.
    generator_module.Generator.read_together = timed(read_together, "read_together",
                                                     "read_rows")
    if readings is not None:
        readings.readings = timed(readings.readings, "readings")
        Scheduler._land = timed(land, "land")


def params_for(prompts: list[Prompt]) -> SamplingParams:
    readout = Readout(top_logprobs=0, cached_prefix=shared_prefix(prompts))
    return SamplingParams(max_tokens=0, temperature=0.0, readout=readout)


async def read_list(engine: Engine, prompts: list[Prompt]) -> None:
    for stream in engine.submit_all(prompts, params_for(prompts)):
        async for event in stream:
            if isinstance(event, Finish):
                break


async def one_at_a_time(engine: Engine, lists: list[list[Prompt]]) -> None:
    for prompts in lists:
        await read_list(engine, prompts)


async def clients(engine: Engine, lists: list[list[Prompt]], count: int) -> None:
    queue = collections.deque(lists)

    async def client() -> None:
        while queue:
            await read_list(engine, queue.popleft())

    await asyncio.gather(*(client() for _ in range(count)))


def scenario(engine: Engine, timeline: Timeline, lists: list[list[Prompt]], run) -> dict:
    asyncio.run(one_at_a_time(engine, lists[:1]))  # the preamble cached, graphs warm
    timeline.seconds.clear()
    timeline.counts.clear()
    timeline.last_step_end = None
    timeline.on = True
    start = time.perf_counter()
    asyncio.run(run(lists))
    wall = time.perf_counter() - start
    timeline.on = False
    return timeline.report(64 * len(lists), wall)


def forward_rows(engine: Engine, lists: list[list[Prompt]]) -> dict:
    scheduler = engine._scheduler
    generator = scheduler.generator
    prompts = [p for prompts in lists for p in prompts]
    depth = shared_prefix(prompts[:64])
    match = scheduler.tree.match(prompts[0].tokens[:depth])
    assert match.length == depth, (match.length, depth)
    spans = segment_spans(scheduler.kv.segments_of(match.node), depth)
    out = {}
    for rows in (64, 128, 256, 512):
        feeds = [p.tokens[depth:] for p in prompts[:rows]]
        times = []
        for i in range(13):
            mx.synchronize()
            start = time.perf_counter()
            queued = generator.read_together([spans] * rows, feeds, 0, (), False)
            if hasattr(queued, "readings"):
                queued.readings()
            mx.synchronize()
            if i >= 3:
                times.append(1000 * (time.perf_counter() - start))
        out[rows] = round(statistics.median(times), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--sentences", type=int, default=4096)
    args = parser.parse_args()
    shapes = Shapes(**dict(H100_SHAPE, cl_sentences=args.sentences))
    workload = next(w for w in build_all(args.model, shapes, 0) if w.name == "classify")
    texts = [conversation.user_turns[0] for conversation in workload.conversations]
    engine = Engine(EngineConfig(model=str(args.model), disk_cache_bytes=0, max_queue=1024))
    engine.start()
    engine.wait_ready()
    lists = [[Prompt(engine.tokenizer.encode(t)) for t in texts[i:i + 64]]
             for i in range(0, len(texts), 64)]
    timeline = Timeline()
    instrument(timeline)
    results = {
        "one_at_a_time": scenario(engine, timeline, lists, lambda ls: one_at_a_time(engine, ls)),
        "four_clients": scenario(engine, timeline, lists, lambda ls: clients(engine, ls, 4)),
        "eight_clients": scenario(engine, timeline, lists, lambda ls: clients(engine, ls, 8)),
    }
    results["forward_rows_ms"] = forward_rows(engine, lists)
    print(json.dumps({"device": str(mx.default_device()), **results}))
    engine.shutdown()


if __name__ == "__main__":
    main()
