"""Batch decode parity: many streams through radix-mlx against bare mlx-lm `BatchGenerator`.

    python -m bench.batch_parity MODEL_DIR --streams 64 --max-tokens 128 --repeats 5 \
        [--out bench/results/<hardware>/<name>] [--no-server]

The batch_decode workload times whole runs, prefill ramp included, one run per server. This
one isolates the decode step: one process alternates, `repeats` times, the same greedy
decode of the same `streams` token prompts through bare `BatchGenerator` (all inserted at
once, one `next()` per step), through radix-mlx's engine (`Engine.submit` per stream, the
events read on one asyncio loop, as the server reads them) and, unless --no-server,
through a radix-mlx server process (one streamed /v1/completions per stream over HTTP, all
at once). Per path: the step time (a stream's mean time per token once every stream
decodes; the median over streams) and output tok/s over the whole run, prefill
included. For the in-process paths, also the CPU time per step of their Python threads
and, for the engine, its own step time (the scheduler's `step_seconds`, without the hop
to the asyncio loop): the host's cost per step, which the machine's load disturbs far
less than wall time. Prints one JSON object; with --out also writes results.json and
results.md there.

In one process, loading the engine's model folds its modules' masked decode attention
(engine/attention.py) for bare `BatchGenerator` too: bare here is mlx-lm with that fold,
where the workload's (bench.raw_batch, a process of its own) is mlx-lm as shipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from bench import hardware
from bench.__main__ import git_revision
from bench.decode_parity import (
    HostClocks,
    add_server_paths,
    engine_counters,
    medians,
    parity_arguments,
    run_lines,
    servers,
    thread_clock,
)
from engine.api import SamplingParams, TokenEvent
from engine.engine import ENGINE_THREAD, Engine, EngineConfig


@dataclass
class Run:
    """One path's run: each stream's token arrival times, and when the run started."""

    started: float
    times: list[list[float]]

    def step_ms(self) -> float:
        """The median over streams of a stream's mean time per token while every stream
        decodes (before the last first token, prompts still being prefilled stretch the
        steps; a stream that ends before then counts whole). A mean, not the median gap:
        a server whose loop falls behind delivers a stream's tokens in bursts, most gaps
        near zero."""
        start, end = max(s[0] for s in self.times), min(s[-1] for s in self.times)
        per_token = []
        for stream in self.times:
            decoding = [t for t in stream if start <= t <= end]
            if len(decoding) < 2:
                decoding = stream
            per_token.append((decoding[-1] - decoding[0]) / (len(decoding) - 1))
        return 1e3 * statistics.median(per_token)

    def tok_s(self) -> float:
        return sum(map(len, self.times)) / (max(s[-1] for s in self.times) - self.started)


def prompts_for(streams: int, length: int, vocab_size: int) -> list[list[int]]:
    return [[(7 * i + 13 * s + 11) % vocab_size for i in range(length)] for s in range(streams)]


def bare(model, prompts: list[list[int]], max_tokens: int) -> Run:
    generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=len(prompts),
                               prefill_batch_size=len(prompts))
    started = time.perf_counter()
    uids = generator.insert(prompts, [max_tokens] * len(prompts))
    times: dict[int, list[float]] = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        now = time.perf_counter()
        for response in responses:
            times[response.uid].append(now)
    generator.close()
    return Run(started, list(times.values()))


def through_engine(engine: Engine, prompts: list[list[int]], max_tokens: int) -> Run:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def read(prompt: list[int]) -> list[float]:
        return [time.perf_counter() async for event in engine.submit(prompt, params)
                if isinstance(event, TokenEvent)]

    async def all_streams() -> Run:
        started = time.perf_counter()
        return Run(started, list(await asyncio.gather(*map(read, prompts))))

    return asyncio.run(all_streams())


def through_server(base_url: str, prompts: list[list[int]], max_tokens: int) -> Run:
    """Each SSE event's arrival (its data line's; no JSON parsing per event: on a 2-core
    machine the client's own cost would slow the server it measures). Each event carries
    one token unless its text was held back (an incomplete character)."""

    async def read(client: httpx.AsyncClient, prompt: list[int]) -> list[float]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True}
        times: list[float] = []
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if line.startswith("data:"):
                    times.append(time.perf_counter())
        return times[:-1]  # the last event is [DONE]

    async def all_streams() -> Run:
        limits = httpx.Limits(max_connections=len(prompts))
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            started = time.perf_counter()
            return Run(started, list(await asyncio.gather(*(read(client, p) for p in prompts))))

    return asyncio.run(all_streams())


def measure(runs: dict[str, Callable[[], Run]], host: HostClocks, max_tokens: int,
            repeats: int) -> dict:
    """Medians of `repeats` alternating runs of each path, and of the CPU per step (ms)
    and the engine's own step times that `host` reads around them."""
    for run in runs.values():  # compile kernels, warm caches
        run()
    step: dict[str, list[float]] = {name: [] for name in runs}
    rate: dict[str, list[float]] = {name: [] for name in runs}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for name, run in runs.items():
            result = host.around(name, run, max_tokens)
            step[name].append(result.step_ms())
            rate[name].append(result.tok_s())
    return {
        "step_ms": {name: statistics.median(values) for name, values in step.items()},
        "output_tok_s": {name: statistics.median(values) for name, values in rate.items()},
        "engine_step_ms": medians(host.steps),
        "host_cpu_ms_per_step": medians(host.cpu),
        "runs": {"step_ms": step, "output_tok_s": rate, "engine_step_ms": host.steps},
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def main() -> None:
    parser = parity_arguments(__doc__.splitlines()[0], max_tokens=128, repeats=5)
    parser.add_argument("--streams", type=int, default=64)
    args = parser.parse_args()
    model, tokenizer = load(str(args.model))
    prompts = prompts_for(args.streams, args.prompt_tokens, tokenizer.vocab_size)
    engine = Engine(EngineConfig(model=str(args.model), max_batch_size=args.streams,
                                 disk_cache_bytes=0))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(f"the engine did not start: {engine.error}")
    runs = {"bare": lambda: bare(model, prompts, args.max_tokens),
            "engine": lambda: through_engine(engine, prompts, args.max_tokens)}
    caller = thread_clock(threading.get_ident())
    worker = thread_clock(next(t.ident for t in threading.enumerate()
                               if t.name == ENGINE_THREAD))
    clocks = {"bare": {"caller": caller, "process": time.process_time},
              "engine": {"engine": worker, "caller": caller, "process": time.process_time}}
    counters = {"engine": engine_counters(engine)}
    try:
        with servers(args, ["--max-batch-size", str(args.streams)]) as by_name:
            add_server_paths(by_name, runs, clocks, counters,
                             lambda url: partial(through_server, url, prompts, args.max_tokens))
            result = measure(runs, HostClocks(clocks, counters, 1e3), args.max_tokens,
                             args.repeats)
    finally:
        engine.shutdown()
    result.update(streams=args.streams, prompt_tokens=args.prompt_tokens,
                  max_tokens=args.max_tokens, repeats=args.repeats)
    print(json.dumps(result))
    if args.out:
        write(result, args.out)


def write(result: dict, out: Path) -> None:
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    hardware.write_results(out, "bench.batch_parity", device, "Batch decode parity", result,
                           markdown, git=git_revision())


def markdown(result: dict) -> list[str]:
    bare_step = result["step_ms"]["bare"]
    lines = [
        *run_lines(result),
        (f"Greedy, {result['streams']} streams of {result['prompt_tokens']}-token prompts, "
         f"{result['max_tokens']} tokens each, {result['repeats']} alternating runs per "
         "path; medians."), "",
        "| path | step (time per token), ms | step / bare | output tok/s, prefill included | runs (step ms) |",
        "|---|---:|---:|---:|---|"]
    for name, median in result["step_ms"].items():
        runs = ", ".join(f"{v:.2f}" for v in result["runs"]["step_ms"][name])
        lines.append(f"| {name} | {median:.2f} | {median / bare_step:.2f} | "
                     f"{result['output_tok_s'][name]:.0f} | {runs} |")
    lines += ["", ("The engine's own steps (medians of the scheduler's step_seconds and its "
                   "thread's step_cpu_seconds; without the hop to asyncio or HTTP), "
                   "wherever the engine runs."), "",
              "| path | engine step wall ms | engine step CPU ms |", "|---|---:|---:|"]
    lines += [f"| {name} | {step['wall']:.2f} | {step['cpu']:.2f} |"
              for name, step in result["engine_step_ms"].items()]
    lines += ["", ("CPU per step (medians), by Python thread and for the whole process "
              "(MLX's compute threads included): the caller runs bare mlx-lm's loop, or "
              "reads the engine's events on an asyncio loop; a server's loop is its main "
              "thread, its process tree includes its engine process."),
              "", "| path | clock | CPU ms per step |", "|---|---|---:|"]
    for name, per_clock in result["host_cpu_ms_per_step"].items():
        lines += [f"| {name} | {clock} | {ms:.2f} |" for clock, ms in per_clock.items()]
    return lines


if __name__ == "__main__":
    main()
