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
with --out also writes results.json and results.md there. Bare mlx-lm and the engine in
process share MLX's process-wide CUDA settings, fixed by the first work on the device
(bare mlx-lm's load, so MLX's defaults: CUDA graphs on); the server process runs with the
engine's own (engine/platform_info.py: graphs off).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx
import mlx.core as mx
import psutil
from mlx_lm import load, stream_generate
from prometheus_client.parser import text_string_to_metric_families

from bench import hardware
from bench.__main__ import git_revision
from bench.servers import RADIX, RunningServer, running
from engine.api import SamplingParams, TokenEvent
from engine.engine import ENGINE_THREAD, Engine, EngineConfig
from engine.platform_info import cpu_reexec_env

T = TypeVar("T")


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
    """A time per token: each chunk's arrival, for the tokens it carries. Without
    logprobs (which the engine would compute at every step, a cost the other paths do
    not pay) a chunk does not say how many tokens it holds (a token whose text is held
    back rides with a later one): the count comes from the usage chunk, the missing
    tokens take the last chunk's time, and the rate needs only the first and last."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    tokens = 0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                now = time.perf_counter()
                chunk = json.loads(line[5:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk["choices"]):
                    times.append(now)
    return times + times[-1:] * (tokens - len(times))


def thread_clock(ident: int) -> Callable[[], float]:
    """CPU seconds of one thread (by `threading` ident) of this process."""
    return lambda: time.clock_gettime(time.pthread_getcpuclockid(ident))


def tree_clock(pid: int) -> Callable[[], float]:
    """CPU seconds of another process and its children (a server and its engine
    process), MLX's compute threads included."""
    process = psutil.Process(pid)
    children = process.children()
    return lambda: sum(sum(p.cpu_times()[:2]) for p in (process, *children))


def main_thread_clock(pid: int) -> Callable[[], float]:
    """Another process's main thread (the server's asyncio loop, uvicorn's)."""
    process = psutil.Process(pid)
    return lambda: next(t.user_time + t.system_time for t in process.threads() if t.id == pid)


Counters = Callable[[], tuple[float, float, float]]  # engine steps: (count, wall s, CPU s)


def engine_counters(engine: Engine) -> Counters:
    def read() -> tuple[float, float, float]:
        counters = engine.stats().counters
        return counters.steps, counters.step_seconds, counters.step_cpu_seconds

    return read


def server_counters(base_url: str) -> Counters:
    """A server's engine counters, from its /metrics."""
    def read() -> tuple[float, float, float]:
        text = httpx.get(f"{base_url}/metrics", timeout=60).text
        values = {sample.name: sample.value for family in text_string_to_metric_families(text)
                  for sample in family.samples if set(sample.labels) <= {"model"}}
        return tuple(values[f"radix_mlx_engine_{name}_total"]
                     for name in ("steps", "step_seconds", "step_cpu_seconds"))

    return read


class HostClocks:
    """Read around each run of a path: its CPU `clocks` (its Python threads, a server's
    process tree), per unit of work, and its engine's own steps' wall and CPU time
    (`counters`), whichever process the engine runs in; `scale`: 1e6 for µs, 1e3 for ms."""

    def __init__(self, clocks: dict[str, dict[str, Callable[[], float]]],
                 counters: dict[str, Counters], scale: float) -> None:
        self.clocks, self.counters, self.scale = clocks, counters, scale
        self.cpu = {name: {clock: [] for clock in per} for name, per in clocks.items()}
        self.steps = {name: {"wall": [], "cpu": []} for name in counters}

    def around(self, name: str, run: Callable[[], T], units: int) -> T:
        clocks = self.clocks.get(name, {})
        before = {clock: read() for clock, read in clocks.items()}
        engine_before = self.counters[name]() if name in self.counters else None
        result = run()
        for clock, read in clocks.items():
            self.cpu[name][clock].append(self.scale * (read() - before[clock]) / units)
        if engine_before is not None:
            steps, wall, cpu = (b - a for a, b in zip(engine_before, self.counters[name]()))
            self.steps[name]["wall"].append(self.scale * wall / steps)
            self.steps[name]["cpu"].append(self.scale * cpu / steps)
        return result


def medians(samples: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {name: {key: statistics.median(values) for key, values in per.items()}
            for name, per in samples.items()}


def measure(runs: dict[str, Callable[[], list[float]]], host: HostClocks, tokens: int,
            repeats: int) -> dict:
    """Medians of `repeats` alternating runs of each path, and of the CPU per token and
    engine step times that `host` reads around them: the host's work, which the
    machine's load disturbs far less than wall time."""
    for run in runs.values():  # compile kernels, warm caches
        run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for name, run in runs.items():
            times = host.around(name, run, tokens)
            if len(times) != tokens:
                raise RuntimeError(f"{name}: {len(times)} tokens, expected {tokens}")
            samples[name].append(rate(times))
    rates = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "decode_tok_s": rates,
        "ratio_to_bare": {name: rates[name] / rates["bare"] for name in rates},
        "host_cpu_us_per_token": medians(host.cpu),
        "engine_step_us": medians(host.steps),
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
    parser.add_argument(
        "--server-variant", action="append", default=[], metavar="NAME=FLAGS",
        help="instead of one server, one per variant (path server:NAME), its flags after "
        "--radix-mlx-args; repeatable, e.g. 'process=--engine-process true'")
    parser.add_argument("--out", type=Path, help="also write results.json and results.md here")
    return parser


def server_variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each server path's name and its radix-mlx flags."""
    common = shlex.split(args.radix_mlx_args)
    if not args.server_variant:
        return {"server": common}
    return {f"server:{name}": [*common, *shlex.split(flags)]
            for name, flags in (variant.split("=", 1) for variant in args.server_variant)}


@contextlib.contextmanager
def servers(args: argparse.Namespace, flags: list[str]) -> Iterator[dict[str, RunningServer]]:
    """Every server path's server (none with --no-server), started one after the other,
    all stopped at the end."""
    if args.no_server:
        yield {}
        return
    env = cpu_reexec_env() or dict(os.environ)
    logs = (args.out or Path("build")) / "logs"
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(running(
                   RADIX, args.model, env, logs / f"radix-mlx-{name.replace(':', '-')}.log",
                   [*flags, *variant]))
               for name, variant in server_variants(args).items()}


def add_server_paths(by_name: dict[str, RunningServer], runs: dict[str, Callable[[], T]],
                     clocks: dict[str, dict[str, Callable[[], float]]],
                     counters: dict[str, Counters], run: Callable[[str], Callable[[], T]],
                     ) -> None:
    """Each server's path: its run (`run` of its base URL), its loop's and process
    tree's CPU clocks, and its engine's counters."""
    for name, server in by_name.items():
        runs[name] = run(server.base_url)
        pid = server.process.pid
        clocks[name] = {"loop": main_thread_clock(pid), "process tree": tree_clock(pid)}
        counters[name] = server_counters(server.base_url)


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
    caller = thread_clock(threading.get_ident())
    worker = thread_clock(next(t.ident for t in threading.enumerate()
                               if t.name == ENGINE_THREAD))
    clocks = {"bare": {"caller": caller}, "engine": {"engine": worker, "caller": caller}}
    counters = {"engine": engine_counters(engine)}
    try:
        with servers(args, []) as by_name:
            add_server_paths(by_name, runs, clocks, counters,
                             lambda url: partial(through_server, url, prompt, args.max_tokens))
            result = measure(runs, HostClocks(clocks, counters, 1e6), args.max_tokens,
                             args.repeats)
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
    lines += ["", ("Host CPU per token (medians), by Python thread (the caller runs bare "
                   "mlx-lm's loop, or reads the engine's events on an asyncio loop; a "
                   "server's loop is its main thread) and a server's process tree (its "
                   "engine process included)."), "",
              "| path | clock | CPU µs per token |", "|---|---|---:|"]
    for name, per_clock in result["host_cpu_us_per_token"].items():
        lines += [f"| {name} | {clock} | {us:.0f} |" for clock, us in per_clock.items()]
    lines += ["", ("The engine's steps (medians; the scheduler's step_seconds and its "
                   "thread's step_cpu_seconds), wherever the engine runs."), "",
              "| path | step wall µs | step CPU µs |", "|---|---:|---:|"]
    lines += [f"| {name} | {step['wall']:.0f} | {step['cpu']:.0f} |"
              for name, step in result["engine_step_us"].items()]
    return lines


if __name__ == "__main__":
    main()
