"""`make soak`: the load test's storm for minutes instead of seconds, on the real default
model, with its figures over time.

    python -m tests.reliability.soak [--minutes 30] [--out DIR] [--model M]
        [--disk-cache-dir DIR] [--server-args "--kv-bits 8"]

One server (API key, 2 MiB radix budget, a queue of 16 so bursts overflow it, the fault
token armed) takes rounds of the storm until the time is up: chat and legacy requests,
streamed and whole, forced tool calls and JSON-schema answers, disconnects, abandoned
requests, bad input, failing forward passes. After each round, once the engine is idle,
a sample records the process's RSS, MLX's active memory, the tree's bytes, the pinned
tokens, and the 5xx and unexpected answers so far. The samples go to `series.csv` and
`soak.png` in the output directory, the figures to `summary.txt`.

With `--disk-cache-dir DIR` the server keeps a disk tier there under the same small
memory budget, so nearly everything it caches is demoted and promoted again; its system
prompts are agent-sized (~600 tokens); every round clears the cache (`DELETE
/admin/cache`) while requests run, and every `--restart-every` rounds it restarts, the
next round's requests racing its rebuild from the folder. At the end every file in the
folder is checked against a fresh forward of its tokens (tests/engine/kv_integrity.py).

It fails (exit status 1) when a disk file's KV is not that of its tokens, or when an
answer is not one its kind allows, a 5xx comes from anything but a deliberately failed
forward pass, a repeatable answer (greedy or seeded) differs from the same request run
alone, anything stays running or pinned, the tree exceeds its budget, or memory grows
without bound: the slope of RSS or of MLX active memory, fitted over the samples after
the first fifth of the run (warm-up), above `MAX_SLOPE_MIB_PER_HOUR`.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import itertools
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import mlx_lm
import psutil

from engine.model_source import resolve_model
from tests.engine.kv_integrity import check_folder
from tests.reliability.storm import (
    Spec,
    Tally,
    Workload,
    baseline,
    figures,
    rerun_alone,
    storm,
)
from tests.reliability.support import (
    AUTH,
    CACHE_BYTES,
    MAX_BODY_BYTES,
    fault_token,
    launch,
    stop,
)
from tests.server.support import ServerProcess, wait_idle

MIB = 2**20
# A leak of this rate would take a 64 GB machine down in weeks; growth below it over a
# half-hour run is noise (buffer caches, allocator arenas settling).
MAX_SLOPE_MIB_PER_HOUR = 32.0
WARM_UP_SHARE = 0.2
QUEUE = 16
DISK_CACHE_BYTES = 2**30
# ~600 tokens: the system prompts agent SDK loops send.
AGENT_SYSTEM_SENTENCES = 40


@dataclass
class Sample:
    seconds: float
    requests: int
    rss_mib: float
    mlx_active_mib: float
    tree_mib: float
    pinned_tokens: float
    server_errors: int  # 5xx answers not asked for by a failing forward pass
    unexpected: int


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--round", type=int, default=120, help="requests between samples")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="model directory or GGUF; default: the default model")
    parser.add_argument("--out", type=Path, help="where the series, plot and summary go")
    parser.add_argument("--disk-cache-dir", type=Path,
                        help="keep a disk tier here: clears mid-round, restarts, file check")
    parser.add_argument("--restart-every", type=int, default=2,
                        help="rounds between restarts, with --disk-cache-dir")
    parser.add_argument("--server-args", default="",
                        help='more flags for the server, in one string: "--kv-bits 8"')
    args = parser.parse_args(argv)
    out = args.out or Path("build/soak") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    model = Path(resolve_model(args.model))
    flags = ["--cache-bytes", str(CACHE_BYTES), "--max-queue", str(QUEUE),
             "--max-body-bytes", str(MAX_BODY_BYTES)]
    if args.disk_cache_dir:
        flags += ["--disk-cache-dir", str(args.disk_cache_dir),
                  "--disk-cache-bytes", str(DISK_CACHE_BYTES)]
    flags += shlex.split(args.server_args)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        servers = Servers(lambda: launch(model, log.with_suffix(f".{time.time()}.log"), *flags,
                                         fault_token=fault_token(model)))
        try:
            return soak(servers, model, args, out)
        finally:
            servers.stop()
            (out / "server.log").write_text("".join(
                path.read_text(errors="replace") for path in sorted(Path(tmp).glob("*.log"))))


class Servers:
    """The server under soak, started anew by `restart` (its disk tier stays)."""

    def __init__(self, start: Callable[[], ServerProcess]) -> None:
        self.start, self.current = start, start()
        self.restarts = 0

    def restart(self) -> None:
        stop(self.current)
        self.current = self.start()
        self.restarts += 1

    def stop(self) -> None:
        stop(self.current)


def soak(servers: Servers, model: Path, args: argparse.Namespace, out: Path) -> int:
    context = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    disk = args.disk_cache_dir is not None
    workload = Workload(args.seed, fault_token(model), context,
                        system_sentences=AGENT_SYSTEM_SENTENCES if disk else 6)
    server = servers.current
    process = psutil.Process(server.process.pid)
    before = baseline(server)
    tally = Tally()
    started = time.monotonic()
    samples = [sample(0.0, tally, before, process)]
    print(f"soak of {model.name} for {args.minutes:g} min into {out}"
          + (f", server flags {args.server_args}" if args.server_args else ""), flush=True)
    deadline = started + args.minutes * 60
    rounds = since_restart = 0
    while time.monotonic() < deadline:
        specs = itertools.takewhile(lambda _: time.monotonic() < deadline,
                                    workload.specs(args.round))
        asyncio.run(round_of(server.url, specs, args.concurrency, tally, clear=disk))
        samples.append(sample(time.monotonic() - started, tally, wait_idle(server), process))
        print(describe(samples[-1]), flush=True)
        rounds += 1
        if disk and rounds % args.restart_every == 0 and time.monotonic() < deadline:
            servers.restart()  # the next round races the rebuild
            since_restart = len(samples)
            server = servers.current
            process = psutil.Process(server.process.pid)
    after = wait_idle(server)
    mismatches = asyncio.run(rerun_alone(server.url, tally))
    problems = [*tally.unexpected, *mismatches]
    tier = []
    if disk:
        servers.stop()
        checked = check_folder(only_folder(args.disk_cache_dir), mlx_lm.load(str(model))[0])
        problems += [f"disk file: {line}" for line in checked.problems]
        tier.append(f"disk tier            {servers.restarts} restarts, {rounds} mid-round "
                    f"clears, {checked.segments} segment and {checked.snapshots} snapshot "
                    f"files checked ({checked.orphans} orphans unread), "
                    f"{len(checked.problems)} wrong")
    if samples[-1].server_errors:
        problems.append(f"{samples[-1].server_errors} answers were 5xx")
    if any(after[name] for name in ("radix_mlx_running_requests", "radix_mlx_queue_depth",
                                    "radix_mlx_tree_pinned_bytes")):
        problems.append("the engine is not idle after the storm")
    if after["radix_mlx_tree_bytes"] > after["radix_mlx_tree_capacity_bytes"]:
        problems.append("the radix tree is over its budget")
    # A leak is one process's growth: the slopes are the last process's.
    slopes = {name: slope_mib_per_hour(samples[since_restart:], name)
              for name in ("rss_mib", "mlx_active_mib")}
    for name, value in slopes.items():
        if value > MAX_SLOPE_MIB_PER_HOUR:
            problems.append(f"{name} grows {value:.1f} MiB/hour after warm-up "
                            f"(limit {MAX_SLOPE_MIB_PER_HOUR:g})")
    summary = "\n".join([
        figures(tally, before, after, time.monotonic() - started),
        *tier,
        (f"memory slope         RSS {slopes['rss_mib']:+.2f} MiB/hour, MLX active "
         f"{slopes['mlx_active_mib']:+.2f} MiB/hour (after the first "
         f"{WARM_UP_SHARE:.0%} of the run)"),
        f"5xx answers          {samples[-1].server_errors} (besides the failed forward passes)",
        f"pinned after         {after['radix_mlx_tree_pinned_tokens']:.0f} tokens",
        f"repeatable mismatches {len(mismatches)}",
        *(f"PROBLEM: {problem}" for problem in problems[:20]),
        "soak: " + ("FAILED" if problems else "passed"),
    ])
    print(summary)
    (out / "summary.txt").write_text(summary + "\n")
    write_series(samples, out / "series.csv")
    plot(samples, out / "soak.png", model.name)
    return 1 if problems else 0


async def round_of(url: str, specs: Iterator[Spec], concurrency: int, tally: Tally,
                   clear: bool) -> None:
    """One round of the storm; with `clear`, the cache is cleared while it runs."""
    async def clear_midway() -> None:
        await asyncio.sleep(random.uniform(0.5, 3.0))
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.delete(f"{url}/admin/cache", headers=AUTH)
            if response.status_code != 200:
                tally.unexpected.append(f"DELETE /admin/cache: {response.status_code}")

    await asyncio.gather(storm(url, specs, concurrency, tally),
                         *([clear_midway()] if clear else []))


def only_folder(directory: Path) -> Path:
    """The one model folder of a disk tier's directory."""
    (folder,) = [path for path in directory.iterdir() if path.is_dir()]
    return folder


def sample(seconds: float, tally: Tally, metrics: dict[str, float],
           process: psutil.Process) -> Sample:
    server_errors = sum(count for (kind, status), count in tally.answers.items()
                        if status >= 500 and kind != "failing forward")
    return Sample(seconds, sum(tally.sent.values()), process.memory_info().rss / MIB,
                  metrics["radix_mlx_active_memory_bytes"] / MIB,
                  metrics["radix_mlx_tree_bytes"] / MIB, metrics["radix_mlx_tree_pinned_tokens"],
                  server_errors, len(tally.unexpected))


def describe(s: Sample) -> str:
    return (f"{s.seconds:6.0f} s  {s.requests:6d} requests  RSS {s.rss_mib:.0f} MiB  "
            f"MLX active {s.mlx_active_mib:.1f} MiB  tree {s.tree_mib:.2f} MiB  "
            f"pinned {s.pinned_tokens:.0f}  5xx {s.server_errors}  unexpected {s.unexpected}")


def slope_mib_per_hour(samples: list[Sample], name: str) -> float:
    """The least-squares slope of one series over the samples after warm-up (none: 0, as
    for a process restarted as the time ran out)."""
    if not samples:
        return 0.0
    end = samples[-1].seconds
    kept = [s for s in samples if s.seconds >= WARM_UP_SHARE * end]
    if len(kept) < 3:
        return 0.0
    slope, _ = statistics.linear_regression([s.seconds for s in kept],
                                            [getattr(s, name) for s in kept])
    return slope * 3600


def write_series(samples: list[Sample], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(samples[0])))
        writer.writeheader()
        writer.writerows(asdict(s) for s in samples)


def plot(samples: list[Sample], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.seconds / 60 for s in samples]
    panels = (("rss_mib", "process RSS (MiB)"), ("mlx_active_mib", "MLX active memory (MiB)"),
              ("tree_mib", "radix tree (MiB)"), ("pinned_tokens", "pinned tokens (idle)"),
              ("server_errors", "5xx answers (cumulative)"),
              ("unexpected", "unexpected answers (cumulative)"))
    figure, axes = plt.subplots(3, 2, figsize=(11, 9), sharex=True)
    for axis, (name, title) in zip(axes.flat, panels):
        axis.plot(minutes, [getattr(s, name) for s in samples], marker=".")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    for axis in axes[-1]:
        axis.set_xlabel("minutes")
    figure.suptitle(f"make soak: {model}, {samples[-1].requests} requests")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
