"""What the disk tier's copies cost a burst of new prompts: evaluated one copy at a time
as each node is published (`DiskStore.evaluate` = `_evaluate_now`, as before 2026-11-29)
or with the engine's other new handles at its settle (`KVStore.after_settle`, now).

    python bench/experiments/disk-save-evals-1b/burst.py MODEL_DIR [--rounds 6] \
        [--prompts 64] [--prompt-tokens 256] [--max-tokens 1,32]

One engine, its disk tier on (a temporary folder); the two ways alternate round by round,
each round `prompts` new random prompts at once. Per way and max_tokens: the median wall
time of a round, its TTFT p50, and the engine thread's CPU. One JSON line per setting.
"""

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import threading
import time

import psutil

from engine import disk_store
from engine.api import EngineConfig, SamplingParams
from engine.engine import ENGINE_THREAD, Engine


def thread_cpu(native_id: int) -> float:
    for thread in psutil.Process().threads():
        if thread.id == native_id:
            return thread.user_time + thread.system_time
    raise LookupError(native_id)


async def burst(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    started = time.perf_counter()

    async def one(prompt: list[int]) -> float:
        first = None
        async for _ in engine.submit(prompt, params):
            first = first or time.perf_counter() - started
        return first

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", default="1,32")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, max_batch_size=args.prompts,
                                 disk_cache_bytes=8 << 30, disk_cache_dir=tempfile.mkdtemp()))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(engine.error)
    after_settle = engine.disk.evaluate
    ways = {"each copy": disk_store._evaluate_now, "at settle": after_settle}
    native_id = next(t.native_id for t in threading.enumerate() if t.name == ENGINE_THREAD)
    rng = random.Random(0)
    try:
        for max_tokens in map(int, args.max_tokens.split(",")):
            runs = {name: [] for name in ways}
            for round_ in range(args.rounds + 1):
                for name, evaluate in ways.items():
                    engine.disk.evaluate = evaluate
                    prompts = [[rng.randrange(100, 30000) for _ in range(args.prompt_tokens)]
                               for _ in range(args.prompts)]
                    cpu, started = thread_cpu(native_id), time.perf_counter()
                    ttfts = asyncio.run(burst(engine, prompts, max_tokens))
                    wall = time.perf_counter() - started
                    engine.disk.flush(60)
                    if round_:  # the first round of each warms up
                        runs[name].append((wall, statistics.median(ttfts),
                                           thread_cpu(native_id) - cpu))
            for name, values in runs.items():
                print(json.dumps({
                    "way": name, "max_tokens": max_tokens, "prompts": args.prompts,
                    "prompt_tokens": args.prompt_tokens,
                    "wall_ms": [round(w * 1e3, 1) for w, _, _ in values],
                    "wall_ms_p50": round(statistics.median(w for w, _, _ in values) * 1e3, 1),
                    "ttft_ms_p50": round(statistics.median(t for _, t, _ in values) * 1e3, 1),
                    "engine_cpu_ms_p50": round(statistics.median(c for _, _, c in values) * 1e3, 1),
                    "disk_writes": engine.disk.stats.writes}), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
