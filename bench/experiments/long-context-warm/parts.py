"""A warm long-context question through the in-process engine, timed by part.

    python bench/experiments/long-context-warm/parts.py MODEL_DIR [--document 6000]

Each engine function below is wrapped to synchronize the device before and after it, so
its time is its own host and device work (inclusive of what it calls; the pipelining
it would overlap is lost). Per question (fresh tokens, 30-60 new after the document):
the medians over 12 questions of each function's total time in ms and its calls, and
the time to first token with the timers on.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import time

import mlx.core as mx
from measure import first_token  # this script's folder is on sys.path

from engine import generator, scheduler
from engine.engine import Engine, EngineConfig

TIMED = {
    generator: ["assemble"],
    generator.Generator: ["prefill", "decode", "_feed", "_join", "_decode", "_enter"],
    scheduler.Scheduler: ["_step", "_start", "_publish", "_prompts_computed", "_take", "_end",
                          "_release"],
}


def wrap(spent: collections.Counter, calls: collections.Counter) -> None:
    for owner, names in TIMED.items():
        for name in names:
            function = getattr(owner, name)

            def timed(*args, _function=function, _name=name, **kwargs):
                mx.synchronize()
                start = time.perf_counter()
                try:
                    return _function(*args, **kwargs)
                finally:
                    mx.synchronize()
                    spent[_name] += 1000 * (time.perf_counter() - start)
                    calls[_name] += 1
            setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--document", type=int, default=6000)
    args = parser.parse_args()
    rng = random.Random(0)
    spent, calls = collections.Counter(), collections.Counter()
    wrap(spent, calls)
    engine = Engine(EngineConfig(model=args.model, disk_cache_bytes=0))
    engine.start()
    engine.wait_ready()
    document = [rng.randrange(1000, 40000) for _ in range(args.document)]
    asyncio.run(first_token(engine, document + [5, 6, 7]))
    per_question: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(12):
        spent.clear()
        calls.clear()
        question = [rng.randrange(1000, 40000) for _ in range(rng.randrange(30, 61))]
        per_question["ttft"].append(asyncio.run(first_token(engine, document + question)))
        time.sleep(0.05)  # the request's ending steps, counted with it
        for name, ms in spent.items():
            per_question[name].append(ms)
            per_question[name + "_calls"].append(calls[name])
    engine.shutdown()
    print(json.dumps({"device": str(mx.default_device()), "document": args.document,
                      "median": {k: round(statistics.median(v), 2)
                                 for k, v in per_question.items()},
                      "ttft": [round(x, 1) for x in per_question["ttft"]]}))


if __name__ == "__main__":
    main()
