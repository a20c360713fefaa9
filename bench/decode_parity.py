"""Single-stream decode parity: radix-mlx against bare `mlx_lm.stream_generate`, in one run.

    python -m bench.decode_parity MODEL_DIR --max-tokens 256 --repeats 7 \
        [--out bench/results/<hardware>/<name>] [--no-server]

The benchmark's single_stream workload meets bare mlx-lm in another process, minutes
later, two or three runs each: on a shared machine (or a GPU whose bare rate ranged 287 to
481 tok/s in one session) that noise is larger than the gap being chased. Here one
process alternates, `repeats` times, the same greedy decode of the same token prompt
through bare `mlx_lm.stream_generate`, through radix-mlx's engine (`Engine.submit`, its
events read on an asyncio loop, as the server reads them) and, unless --no-server,
through a radix-mlx server process on the same model (streamed /v1/completions over
HTTP). Each rate is (tokens - 1) / (last token - first token): prefill excluded. Prints
one JSON object (medians, ratios to bare, every run, the load average around the runs,
and for the in-process paths the CPU time per token of their Python threads, which the
machine's load disturbs far less than wall time: the host cost per step, measured);
with --out also writes results.json and results.md there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import mlx.core as mx
from mlx_lm import load, stream_generate

from bench import hardware
from bench.__main__ import git_revision
from bench.servers import RADIX, running
from engine.api import SamplingParams, TokenEvent
from engine.engine import ENGINE_THREAD, Engine, EngineConfig
from engine.platform_info import openblas_preload_env


def rate(times: list[float]) -> float:
    """Tokens per second after the first token."""
    return (len(times) - 1) / (times[-1] - times[0])


def timed(tokens: Iterable[object]) -> list[float]:
    return [time.perf_counter() for _ in tokens]


def bare(model, tokenizer, prompt: list[int], max_tokens: int) -> list[float]:
    return timed(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))


def through_engine(engine: Engine, prompt: list[int], max_tokens: int) -> list[float]:
    async def read() -> list[float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [time.perf_counter() async for event in engine.submit(prompt, params)
                if isinstance(event, TokenEvent)]

    return asyncio.run(read())


def through_server(base_url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """A time per token: with `logprobs` every token's chunk lists it, even a token whose
    text is held back (an incomplete character)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "logprobs": 0}
    times = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                now = time.perf_counter()
                for choice in json.loads(line[5:])["choices"]:
                    times += [now] * len((choice["logprobs"] or {}).get("tokens", ()))
    return times


def thread_seconds(threads: dict[str, int]) -> dict[str, float]:
    """CPU seconds each named thread (by `threading` ident) of this process has used."""
    return {name: time.clock_gettime(time.pthread_getcpuclockid(ident))
            for name, ident in threads.items()}


def measure(runs: dict[str, Callable[[], list[float]]], threads: dict[str, dict[str, int]],
            tokens: int, repeats: int) -> dict:
    """Medians of `repeats` alternating runs of each path; for a path run in this process,
    also the CPU time per token of its Python threads (`threads[path]`): the host's work,
    apart from MLX's own compute threads and from how busy the machine is."""
    for run in runs.values():  # compile kernels, warm caches
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, dict[str, list[float]]] = {
        name: {thread: [] for thread in threads.get(name, {})} for name in runs}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for name, run in runs.items():
            before = thread_seconds(threads.get(name, {}))
            times = run()
            after = thread_seconds(threads.get(name, {}))
            if len(times) != tokens:
                raise RuntimeError(f"{name}: {len(times)} tokens, expected {tokens}")
            samples[name].append(rate(times))
            for thread in cpu[name]:
                cpu[name][thread].append(1e6 * (after[thread] - before[thread]) / tokens)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "decode_tok_s": medians,
        "ratio_to_bare": {name: medians[name] / medians["bare"] for name in medians},
        "host_cpu_us_per_token": {
            name: {thread: statistics.median(values) for thread, values in per.items()}
            for name, per in cpu.items() if per},
        "runs": samples,
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def parity_arguments(description: str, max_tokens: int, repeats: int) -> argparse.ArgumentParser:
    """The flags of a parity benchmark (this one, bench.batch_parity)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--no-server", action="store_true", help="skip the HTTP path")
    parser.add_argument("--radix-mlx-args", default="", metavar="FLAGS")
    parser.add_argument("--out", type=Path, help="also write results.json and results.md here")
    return parser


def main() -> None:
    args = parity_arguments(__doc__.splitlines()[0], max_tokens=256, repeats=7).parse_args()
    model, tokenizer = load(str(args.model))
    prompt = [(7 * i + 11) % tokenizer.vocab_size for i in range(args.prompt_tokens)]
    engine = Engine(EngineConfig(model=str(args.model)))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(f"the engine did not start: {engine.error}")
    runs = {"bare": lambda: bare(model, tokenizer, prompt, args.max_tokens),
            "engine": lambda: through_engine(engine, prompt, args.max_tokens)}
    caller = threading.get_ident()
    worker = next(t.ident for t in threading.enumerate() if t.name == ENGINE_THREAD)
    threads = {"bare": {"caller": caller}, "engine": {"engine": worker, "caller": caller}}
    try:
        if args.no_server:
            result = measure(runs, threads, args.max_tokens, args.repeats)
        else:
            env = openblas_preload_env() or dict(os.environ)
            log = (args.out or Path("build")) / "logs" / "radix-mlx.log"
            with running(RADIX, args.model, env, log, shlex.split(args.radix_mlx_args)) as server:
                runs["server"] = lambda: through_server(server.base_url, prompt, args.max_tokens)
                result = measure(runs, threads, args.max_tokens, args.repeats)
    finally:
        engine.shutdown()
    result.update(prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                  repeats=args.repeats)
    print(json.dumps(result))
    if args.out:
        write(result, args.out)


def write(result: dict, out: Path) -> None:
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    hardware.write_results(out, "bench.decode_parity", device, "Single-stream decode parity",
                           result, markdown, git=git_revision())


def run_lines(result: dict) -> list[str]:
    """A parity result's command, commit and the machine's load around its runs."""
    load_average = result["load_average"]
    return [
        f"Command: `{result['command']}` at {result['git']}.",
        "Load average (1, 5, 15 min) before the timed runs: "
        + ", ".join(f"{v:.2f}" for v in load_average["before"]) + "; after: "
        + ", ".join(f"{v:.2f}" for v in load_average["after"]) + "."]


def markdown(result: dict) -> list[str]:
    lines = [
        *run_lines(result),
        (f"Greedy, {result['prompt_tokens']}-token prompt, {result['max_tokens']} tokens, "
         f"{result['repeats']} alternating runs each; medians."), "",
        "| path | decode tok/s | ratio to bare | runs |", "|---|---:|---:|---|"]
    for name, median in result["decode_tok_s"].items():
        runs = ", ".join(f"{v:.0f}" for v in result["runs"][name])
        lines.append(f"| {name} | {median:.1f} | {result['ratio_to_bare'][name]:.3f} | {runs} |")
    lines += ["", ("Host CPU per token (medians), by Python thread: the caller runs bare "
                   "mlx-lm's loop, or reads the engine's events on an asyncio loop."), "",
              "| path | thread | CPU µs per token |", "|---|---|---:|"]
    for name, per_thread in result["host_cpu_us_per_token"].items():
        lines += [f"| {name} | {thread} | {us:.0f} |" for thread, us in per_thread.items()]
    return lines


if __name__ == "__main__":
    main()
