"""A server's host CPU per streamed token and per request, split by thread.

    python -m bench.server_cpu MODEL_DIR [--streams 64] [--prompt-tokens 64] \
        [--max-tokens 128] [--repeats 5] [--tree NAME=SOURCE_DIR ...] [--out DIR]

With the engine in the server's process (the default), the asyncio loop and the engine's
thread share one GIL: every microsecond of Python the server spends admitting a request
(parse, validate, template, tokenize, submit) or relaying a streamed token (event, chunk,
JSON, SSE framing, ASGI send) is taken from the decode loop. On a GPU whose step is a few
ms, that host time is the limit; on this CPU it is what can be counted.

Each server (this tree's, or one per --tree, e.g. a copy of main's, started from that
directory) serves `streams` concurrent streamed chat completions (bench.client, as the
benchmark's batch_decode sends them) twice per repeat: with `max_tokens` tokens each, and
with one. The CPU the one-token run costs, over `streams`, is the cost per request; the
difference between the two runs, over the extra tokens, the cost per streamed token. Each
is split between the asyncio loop (the process's main thread), the engine's thread (found
by name with py-spy, in the server's process or, with `--radix-mlx-args "--engine-process
true"`, in its engine process) and the rest of the process tree (tokenizer threads, MLX's
compute threads). Servers alternate within every repeat, so the machine's load falls on
all of them alike; medians are reported. Wall figures (tok/s, TTFT) come along but move
with the load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil

from bench.__main__ import git_revision
from bench.client import run_workload
from bench.servers import RADIX, RunningServer, running
from bench.workloads import Shapes, TextSource, batch_decode
from engine.engine import ENGINE_THREAD
from engine.platform_info import cpu_reexec_env

THREADS = ("loop", "engine", "other", "process")


def engine_thread(pids: list[int]) -> tuple[int, int]:
    """(process, OS thread id) of a server's engine thread, in the server's process or
    in its engine process (`--engine-process true`). Python names its threads only for
    itself, so py-spy reads the names."""
    for pid in pids:
        dump = subprocess.run([str(Path(sys.executable).with_name("py-spy")), "dump",
                               "--json", "--pid", str(pid)],
                              capture_output=True, text=True, check=False)
        if dump.returncode != 0:
            continue  # not a Python process (a resource tracker that ended, say)
        for thread in json.loads(dump.stdout):
            if thread["thread_name"] == ENGINE_THREAD:
                return pid, thread["os_thread_id"]
    raise RuntimeError(f"no {ENGINE_THREAD} thread in processes {pids}")


def cpu_clocks(pid: int) -> Callable[[], dict[str, float]]:
    """CPU seconds so far of a server's loop, engine thread, its other threads, and the
    whole process tree: each thread's run time from /proc's schedstat, in ns (its stat
    counts 10 ms ticks)."""
    pids = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    engine = engine_thread(pids)

    def run_time(task: Path) -> float:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            return int((task / "schedstat").read_text().split()[0]) / 1e9
        return 0.0  # a thread that ended meanwhile

    def read() -> dict[str, float]:
        threads = {(process, int(task.name)): run_time(task) for process in pids
                   for task in Path(f"/proc/{process}/task").glob("*")}
        total = sum(threads.values())
        clocks = {"loop": threads[pid, pid], "engine": threads.get(engine, 0.0),
                  "process": total}
        clocks["other"] = total - clocks["loop"] - clocks["engine"]
        return clocks

    return read


def one_run(server: RunningServer, read: Callable[[], dict[str, float]],
            source: TextSource, streams: int, prompt_tokens: int, max_tokens: int) -> dict:
    workload = batch_decode(source, Shapes(bd_streams=streams, bd_prompt_tokens=prompt_tokens,
                                           bd_output_tokens=max_tokens))
    before = read()
    run = asyncio.run(run_workload(server.base_url, workload, RADIX.extra))
    after = read()
    failed = [r.error for r in run.requests if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    tokens = sum(r.completion_tokens for r in run.requests)
    ttfts = sorted(r.ttft for r in run.requests)
    return {"cpu_s": {k: after[k] - before[k] for k in THREADS}, "tokens": tokens,
            "wall_s": run.wall_seconds, "tok_s": tokens / run.wall_seconds,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]}


def per_unit(long: dict, short: dict, streams: int) -> dict[str, dict[str, float]]:
    """µs of CPU per request (the one-token run) and per streamed token (the rest)."""
    extra_tokens = long["tokens"] - short["tokens"]
    return {
        "request_us": {k: 1e6 * short["cpu_s"][k] / streams for k in THREADS},
        "token_us": {k: 1e6 * (long["cpu_s"][k] - short["cpu_s"][k]) / extra_tokens
                     for k in THREADS},
    }


def summary(runs: list[dict]) -> dict:
    """Medians over repeats of every figure."""
    def median(path: Callable[[dict], float]) -> float:
        return statistics.median(path(run) for run in runs)

    return {
        "request_us": {k: median(lambda r, k=k: r["request_us"][k]) for k in THREADS},
        "token_us": {k: median(lambda r, k=k: r["token_us"][k]) for k in THREADS},
        "tok_s": median(lambda r: r["long"]["tok_s"]),
        "ttft_p50_s": median(lambda r: r["long"]["ttft_p50_s"]),
        "ttft_p99_s": median(lambda r: r["long"]["ttft_p99_s"]),
    }


def markdown(result: dict) -> list[str]:
    args = result["args"]
    lines = [(f"{args['streams']} streams x {args['max_tokens']} tokens, "
             f"{args['prompt_tokens']}-token prompts; medians of {args['repeats']} "
             "alternating repeats"), "",
             ("| server | CPU µs/token: loop | engine | other | process | "
             "CPU µs/request: loop | engine | other | process | tok/s | TTFT p50 s | p99 s |"),
             "|---|" + "---:|" * 11]
    for name, s in result["servers"].items():
        token, request = s["token_us"], s["request_us"]
        lines.append(f"| {name} | " + " | ".join(f"{token[k]:.1f}" for k in THREADS) + " | "
                     + " | ".join(f"{request[k]:.0f}" for k in THREADS)
                     + f" | {s['tok_s']:.0f} | {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", action="append", default=[],
                        help="NAME=DIR: also a server run from another source tree")
    parser.add_argument("--radix-mlx-args", default="",
                        help="extra server flags, for every server")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = {"this": None, **{name: Path(path) for name, path in
                              (tree.split("=", 1) for tree in args.tree)}}
    env = cpu_reexec_env() or dict(os.environ)
    logs = (args.out or Path("build")) / "logs"
    flags = ["--max-batch-size", str(args.streams), *args.radix_mlx_args.split()]
    source = TextSource(args.model, seed=0)
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(running(
                       RADIX, args.model, env, logs / f"server-cpu-{name}.log", flags, cwd=cwd))
                   for name, cwd in trees.items()}
        clocks = {}
        for name, server in servers.items():
            one_run(server, lambda: dict.fromkeys(THREADS, 0.0), source, 8, 16, 8)  # warm
            clocks[name] = cpu_clocks(server.process.pid)
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for repeat in range(args.repeats):
            order = list(servers) if repeat % 2 == 0 else list(servers)[::-1]
            for name in order:
                shape = (source, args.streams, args.prompt_tokens)
                long = one_run(servers[name], clocks[name], *shape, args.max_tokens)
                short = one_run(servers[name], clocks[name], *shape, 1)
                runs[name].append({"long": long, "short": short,
                                   **per_unit(long, short, args.streams)})
                print(name, json.dumps(runs[name][-1]["token_us"]), file=sys.stderr)
    result = {"commit": git_revision(), "args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()},
              "servers": {name: summary(r) for name, r in runs.items()}, "runs": runs}
    print(json.dumps(result["servers"], indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "results.md").write_text("\n".join(markdown(result)) + "\n")


if __name__ == "__main__":
    main()
