"""Each server's CPU per output token on the CPU's multi-turn workload, and its busiest threads'.

    python bench/experiments/multi-turn-cpu-per-token/cpu_per_token.py MODEL_DIR \
        [--rounds 2] [--out results.json]

Issue 36's CPU multi-turn ITL misses under load (1.08x and 1.14x mlx-lm's server) and not
quiet (0.97-1.02x). With one of the two cores taken, whatever CPU a server spends per
token beyond MLX's kernels is paid on the one core the kernels also need. This runs the
benchmark's multi-turn workload (its default sizes) on radix-mlx and mlx-lm's server,
alternating, and reads each server process tree's CPU time (user + system) around the
workload, in all and for its busiest threads, from /proc/PID/task/*/stat, over the output
tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

import psutil

from bench.client import run_workload
from bench.report import summarize
from bench.servers import MLX_LM, RADIX, running
from bench.workloads import Shapes, build_all, build_warm_up
from engine.platform_info import cpu_reexec_env

TICK = os.sysconf("SC_CLK_TCK")


def thread_times(pid: int) -> dict[str, float]:
    """CPU seconds by thread (process id/thread id) over the process tree."""
    times: dict[str, float] = {}
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        for task in Path(f"/proc/{process.pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            times[f"{process.pid}/{task.name}"] = (int(fields[11]) + int(fields[12])) / TICK
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    env = cpu_reexec_env() or dict(os.environ)
    shapes = Shapes()
    workload = next(w for w in build_all(args.model, shapes, 0) if w.name == "multi_turn")
    warm_up = build_warm_up(args.model, shapes, 0)
    rows: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        for spec in (RADIX, MLX_LM):
            log = Path(f"/tmp/cpu-per-token-{spec.name}-{round_index}.log")
            with running(spec, args.model, env, log) as server:
                extra = {**spec.extra, "temperature": 0.0}
                asyncio.run(run_workload(server.base_url, warm_up, extra))
                before = thread_times(server.process.pid)
                run = asyncio.run(run_workload(server.base_url, workload, extra))
                after = thread_times(server.process.pid)
                summary = summarize(run, 0, None)
                tokens = summary["output_tokens"]
                spent = {name: after[name] - before.get(name, 0.0) for name in after}
                row = {"itl_p50": summary["itl_p50"], "ttft_p50": summary["ttft_p50"],
                       "wall": summary["wall_seconds"], "tokens": tokens,
                       # The busiest threads, each's ms a token: which is which is the
                       # reader's to tell (py-spy dump names the engine's and the loop's).
                       "threads_ms_per_token": sorted(
                           (round(1000 * s / tokens, 2) for s in spent.values() if s > 0),
                           reverse=True)[:8],
                       "total_ms_per_token": round(1000 * sum(spent.values()) / tokens, 2)}
                rows.setdefault(spec.name, []).append(row)
                print(spec.name, json.dumps(row), file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    for name, runs in rows.items():
        print(name, "total CPU ms/token median",
              statistics.median(r["total_ms_per_token"] for r in runs),
              "ITL p50", [round(r["itl_p50"], 1) for r in runs])


if __name__ == "__main__":
    main()
