"""Where an engine step that admits a multi-turn prompt spends its time (diagnostic, device only).

Runs the multi-turn pattern in process (8 conversations, 1000-token system prompt, 200-token
user turns, 64-token replies, 4 turns) through Engine.submit, with the engine's methods
wrapped in timers that synchronize the device before and after (so each one's device work
is charged to it). Prints per-method totals and per-call medians, and the step trace.

    python .dev/admit.py MODEL_DIR [--no-sync] [--keep-buffers]
"""

import asyncio
import collections
import statistics
import sys
import time

import mlx.core as mx

from engine import generator as gen_mod
from engine import kv as kv_mod
from engine import scheduler as sched_mod
from engine.api import SamplingParams, TokenEvent
from engine.engine import Engine, EngineConfig

SYNC = "--no-sync" not in sys.argv
times: dict[str, list[float]] = collections.defaultdict(list)
depth = [0]


def timed(owner, name, label=None):
    original = getattr(owner, name)
    label = label or f"{owner.__name__}.{name}"

    def wrapper(*args, **kwargs):
        if SYNC:
            mx.synchronize()
        start = time.perf_counter()
        depth[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            if SYNC:
                mx.synchronize()
            depth[0] -= 1
            times[label].append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


G, S, K = gen_mod.Generator, sched_mod.Scheduler, kv_mod.KVStore
for owner, name in [(G, "decode"), (G, "_join"), (G, "_enter"), (G, "_decode"), (G, "prefill"),
                    (G, "_feed"), (G, "_build_cache"), (G, "_prefill_together"), (G, "remove"),
                    (G, "caches_of"), (S, "_step"), (S, "_start"), (S, "_prompt_computed"),
                    (S, "_end"), (S, "_release"), (K, "settle"), (K, "handle")]:
    timed(owner, name)
if "--keep-buffers" in sys.argv:
    gen_mod.mx.clear_cache = lambda: None
else:
    timed(gen_mod.mx, "clear_cache", "mx.clear_cache")


def burn() -> None:
    """A pure-Python thread, as the server's loop is while it parses, renders and streams."""
    while True:
        total = 0
        for i in range(20000):
            total += i * i


def main(model: str) -> None:
    if "--burn" in sys.argv:
        import threading
        threading.Thread(target=burn, daemon=True).start()
    if "--switch" in sys.argv:
        sys.setswitchinterval(0.0005)
    engine = Engine(EngineConfig(model=model, max_batch_size=64, disk_cache_bytes=0))
    engine.start()
    assert engine.wait_ready() == "ready", engine.error
    vocab = 30000
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    def text(seed: int, n: int) -> list[int]:
        return [(1009 * seed + 7 * i * i + 13 * i) % vocab + 100 for i in range(n)]

    system = text(1, 1000)
    ttfts: list[list[float]] = [[] for _ in range(4)]

    async def conversation(c: int) -> None:
        history = list(system)
        for turn in range(4):
            prompt = history + text(1000 + 10 * c + turn, 200)
            start = time.perf_counter()
            out = []
            async for event in engine.submit(prompt, params):
                if isinstance(event, TokenEvent):
                    if not out:
                        ttfts[turn].append(time.perf_counter() - start)
                    out.append(event.token)
            history = prompt + out

    async def run_all() -> None:
        await asyncio.gather(*(conversation(c) for c in range(8)))

    asyncio.run(run_all())  # warm: shapes compiled, buffers seen
    for label in list(times):
        times[label].clear()
    for t in ttfts:
        t.clear()
    system = text(2, 1000)
    started = time.perf_counter()
    asyncio.run(run_all())
    wall = time.perf_counter() - started
    engine.shutdown()
    print(f"sync={SYNC} wall {wall:.2f} s; TTFT p50 per turn (ms):",
          [round(1e3 * statistics.median(t), 1) for t in ttfts])
    print(f"{'label':40s} {'calls':>6s} {'total ms':>9s} {'median ms':>9s} {'max ms':>8s}")
    for label, values in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        if values:
            print(f"{label:40s} {len(values):6d} {1e3 * sum(values):9.1f} "
                  f"{1e3 * statistics.median(values):9.2f} {1e3 * max(values):8.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
