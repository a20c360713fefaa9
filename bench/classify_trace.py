"""The classify workload in-process, counted per sentence: what the engine does for it.

    python -m bench.classify_trace MODEL_DIR [--count] [--config '{"max_batch_size": 64}']
        [--cl-sentences 512 --cl-batch 64 --cl-preamble-tokens 48 --cl-sentence-tokens 16]

Runs the workload's lists one after another through an in-process engine (no HTTP), after
two untimed lists and a cleared tree, and prints one JSON object: sentences/s, CPU time
per sentence of the engine thread (its host work: Python, building and dispatching MLX
graphs) and of the process, and per sentence the model forwards, the rows they computed,
`mx.eval`/`mx.async_eval` calls and scheduler steps. With --count it also counts the MLX
primitives every evaluation runs (from the graph `mx.export_to_dot` writes), in all and by
the function that asked: slow, so its timings are not the engine's own. On a GPU, where
every primitive is a kernel launch or host bookkeeping, primitives and evaluations per
sentence are what the engine thread's time per sentence is made of. (Arrays read back with
`tolist`/`item` evaluate without a call to count: small graphs here, but on the CPU a
decode step's forward is among them.)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.workloads import Shapes, build_all
from engine.api import EngineConfig, Finish, Prompt, Readout, SamplingParams
from engine.engine import ENGINE_THREAD, Engine
from server.prefill.jobs import shared_prefix

H100_SHAPE = {"cl_sentences": 512, "cl_batch": 64, "cl_preamble_tokens": 48,
              "cl_sentence_tokens": 16}


class Counts:
    """Evaluations (and optionally their primitives, by caller) and forwards."""

    def __init__(self, primitives: bool) -> None:
        self.primitives = primitives
        self.totals: collections.Counter[str] = collections.Counter()
        self.by_caller: collections.Counter[str] = collections.Counter()

    def evaluation(self, kind: str, arrays: tuple[Any, ...]) -> None:
        self.totals[kind] += 1
        if self.primitives:
            count = _primitives(arrays)
            caller = sys._getframe(2).f_code.co_name
            self.totals["primitives"] += count
            self.by_caller[f"{kind} in {caller}"] += count

    def wrap_evaluations(self) -> None:
        for kind, function in (("evals", mx.eval), ("async_evals", mx.async_eval)):
            def counted(*arrays, _kind=kind, _function=function):
                self.evaluation(_kind, arrays)
                return _function(*arrays)
            setattr(mx, kind[:-1], counted)


def _primitives(arrays: tuple[Any, ...]) -> int:
    flat: list[mx.array] = []

    def walk(value: Any) -> None:
        if isinstance(value, mx.array):
            flat.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(arrays)
    if not flat:
        return 0
    dot = io.StringIO()
    mx.export_to_dot(dot, *flat)
    return dot.getvalue().count("shape=rectangle")


class CountingModel:
    """The model, counting its calls and the rows they computed."""

    def __init__(self, model: Any, counts: Counts) -> None:
        self._model = model
        self._counts = counts

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self._counts.totals["forwards"] += 1
        self._counts.totals["forward_rows"] += inputs.shape[0]
        return self._model(inputs, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def thread_cpu_seconds(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/schedstat") as stat:
        return int(stat.read().split()[0]) / 1e9


async def run(engine: Engine, texts: list[str], batch: int) -> None:
    """Each list as /v1/classify submits it: prompts read at their last position, the
    tree keeping only what the list's prompts share."""
    for start in range(0, len(texts), batch):
        prompts = [Prompt(engine.tokenizer.encode(text)) for text in texts[start:start + batch]]
        readout = Readout(top_logprobs=0, cached_prefix=shared_prefix(prompts))
        params = SamplingParams(max_tokens=0, temperature=0.0, readout=readout)
        streams = engine.submit_all(prompts, params)
        for stream in streams:
            async for event in stream:
                if isinstance(event, Finish):
                    break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--count", action="store_true", help="count primitives (slow)")
    parser.add_argument("--config", default="{}", help="EngineConfig fields, as JSON")
    for name, default in H100_SHAPE.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    args = parser.parse_args()
    shapes = Shapes(**{name: getattr(args, name) for name in H100_SHAPE})
    workload = next(w for w in build_all(args.model, shapes, 0) if w.name == "classify")
    texts = [conversation.user_turns[0] for conversation in workload.conversations]
    engine = Engine(EngineConfig(model=str(args.model), disk_cache_bytes=0,
                                 **json.loads(args.config)))
    engine.start()
    engine.wait_ready()
    scheduler = engine._scheduler
    counts = Counts(args.count)
    counts.wrap_evaluations()
    scheduler.generator.model = CountingModel(scheduler.generator.model, counts)
    engine_thread = next(t.native_id for t in threading.enumerate() if t.name == ENGINE_THREAD)
    asyncio.run(run(engine, texts[:2 * workload.batch], workload.batch))
    scheduler.tree.clear()
    counts.totals.clear()
    counts.by_caller.clear()
    steps = scheduler.counters.steps
    engine_cpu, process_cpu = thread_cpu_seconds(engine_thread), time.process_time()
    wall = time.perf_counter()
    asyncio.run(run(engine, texts, workload.batch))
    wall = time.perf_counter() - wall
    n = len(texts)
    per = {key: round(value / n, 3) for key, value in counts.totals.items()}
    print(json.dumps({
        "sentences": n, "sentences_s": round(n / wall, 1),
        "engine_thread_cpu_ms": round(
            1000 * (thread_cpu_seconds(engine_thread) - engine_cpu) / n, 3),
        "process_cpu_ms": round(1000 * (time.process_time() - process_cpu) / n, 3),
        "steps": round((scheduler.counters.steps - steps) / n, 3),
        **per,
        "primitives_by_caller": {key: round(value / n, 1)
                                 for key, value in counts.by_caller.most_common()},
        "shapes": {name: getattr(shapes, name) for name in H100_SHAPE},
        "config": json.loads(args.config),
        "device": str(mx.default_device())}))
    engine.shutdown()


if __name__ == "__main__":
    main()
