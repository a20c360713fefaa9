"""`make soak`: the load test's storm for minutes instead of seconds, with its figures.

    python -m tests.reliability.soak [--minutes 5] [--round 300] [--concurrency 48]

One server (API key, 2 MiB radix budget, fault token armed) takes rounds of the storm
until the time is up. Between rounds, once the engine is idle, a line shows MLX's active
memory, the tree and the process's RSS, so growth over time stands out. At the end each
greedy request runs again alone, the figures are printed, and the exit status is 1 if
any check of the bounded test fails: an unexpected answer, a greedy mismatch, a request
left running or pinned, a tree over budget, or memory above the baseline's tolerance.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from pathlib import Path

import psutil

from engine.demo_model import MAX_POSITION_EMBEDDINGS, demo_model_path
from tests.reliability.storm import (
    MEMORY_SLACK,
    Tally,
    Workload,
    baseline,
    figures,
    rerun_alone,
    storm,
)
from tests.reliability.support import (
    CACHE_BYTES,
    MAX_BODY_BYTES,
    fault_token,
    launch,
    stop,
    wait_idle,
)
from tests.server.support import ServerProcess

MIB = 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--round", type=int, default=300, help="requests between samples")
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = demo_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        server = launch(model, log, "--cache-bytes", str(CACHE_BYTES),
                        "--max-body-bytes", str(MAX_BODY_BYTES), fault_token=fault_token(model))
        try:
            return soak(server, model, args)
        finally:
            stop(server)


def soak(server: ServerProcess, model: Path, args: argparse.Namespace) -> int:
    workload = Workload(args.seed, fault_token(model), MAX_POSITION_EMBEDDINGS)
    process = psutil.Process(server.process.pid)
    before = baseline(server)
    rss_before = process.memory_info().rss
    print(f"baseline: MLX active {before['radix_mlx_active_memory_bytes'] / MIB:.2f} MiB, "
          f"RSS {rss_before / MIB:.0f} MiB", flush=True)
    tally = Tally()
    started = time.monotonic()
    deadline = started + args.minutes * 60
    while time.monotonic() < deadline:
        specs = itertools.takewhile(lambda _: time.monotonic() < deadline,
                                    workload.specs(args.round))
        asyncio.run(storm(server.url, specs, args.concurrency, tally))
        after = wait_idle(server)
        print(f"{time.monotonic() - started:6.0f} s  {sum(tally.sent.values()):6d} requests  "
              f"MLX active {after['radix_mlx_active_memory_bytes'] / MIB:.2f} MiB  "
              f"tree {after['radix_mlx_tree_bytes'] / MIB:.2f} MiB  "
              f"RSS {process.memory_info().rss / MIB:.0f} MiB  "
              f"unexpected {len(tally.unexpected)}", flush=True)
    seconds = time.monotonic() - started
    after = wait_idle(server)
    mismatches = asyncio.run(rerun_alone(server.url, tally))
    print(figures(tally, before, after, seconds))
    print(f"process RSS          {rss_before / MIB:.0f} MiB before, "
          f"{process.memory_info().rss / MIB:.0f} MiB after")
    print(f"greedy mismatches    {len(mismatches)}")
    problems = [*tally.unexpected, *mismatches]
    if any(after[name] for name in ("radix_mlx_running_requests", "radix_mlx_queue_depth",
                                    "radix_mlx_tree_pinned_bytes")):
        problems.append("the engine is not idle after the storm")
    if after["radix_mlx_tree_bytes"] > after["radix_mlx_tree_capacity_bytes"]:
        problems.append("the radix tree is over its budget")
    growth = after["radix_mlx_active_memory_bytes"] - before["radix_mlx_active_memory_bytes"]
    if growth > MEMORY_SLACK:
        problems.append(f"MLX active memory grew by {growth / MIB:.2f} MiB")
    for problem in problems[:20]:
        print(f"PROBLEM: {problem}")
    print("soak: " + ("FAILED" if problems else "passed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
