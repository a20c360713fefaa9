"""Where radix-mlx's time goes: one workload under py-spy, summarized per function.

    python -m bench.profile MODEL --workload shared_prefix --out DIR [bench shape flags]

Starts radix-mlx, warms it up, samples it with py-spy (all threads of the server and of
its engine process, wall time) while the workload runs, and writes DIR/<workload>.pyspy (raw collapsed stacks, for flamegraph
tools) and DIR/<workload>.txt: per thread, the share of samples in which each function is
on the stack (inclusive) and at the top (self). The engine thread's share in
`mx.eval`/`tolist` is time waiting for the device; the rest of its time is overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

from bench.__main__ import shapes_from
from bench.client import run_workload
from bench.servers import RADIX, running
from bench.workloads import Shapes, build_all, build_warm_up
from engine.platform_info import cpu_reexec_env

TOP = 40


def summarize(raw: Path) -> str:
    """Inclusive and self shares per thread from py-spy's raw (collapsed) output."""
    by_thread: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        by_thread[frames[0]].append((frames[1:], int(count)))
    lines = []
    for thread, stacks in sorted(by_thread.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        total = sum(count for _, count in stacks)
        inclusive: collections.Counter[str] = collections.Counter()
        own: collections.Counter[str] = collections.Counter()
        for frames, count in stacks:
            inclusive.update({frame: count for frame in set(frames)})
            if frames:
                own[frames[-1]] += count
        lines += [f"== {thread}: {total} samples", "-- inclusive"]
        lines += [f"{100 * n / total:5.1f}% {f}" for f, n in inclusive.most_common(TOP)]
        lines += ["-- self"]
        lines += [f"{100 * n / total:5.1f}% {f}" for f, n in own.most_common(TOP // 2)]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--workload", default="shared_prefix")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--radix-mlx-args", default="", metavar="FLAGS")
    parser.add_argument("--py-spy-args", default="", metavar="FLAGS",
                        help="more py-spy flags (--py-spy-args=...): --idle to sample threads "
                        "that wait (device syncs that block, the GIL), --native for MLX's own "
                        "frames")
    parser.add_argument("--quick", action="store_true")
    for name in Shapes.__dataclass_fields__:
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    args = parser.parse_args()
    shapes = shapes_from(args)
    py_spy = shutil.which("py-spy") or "py-spy"
    workload = {w.name: w for w in build_all(args.model, shapes, 0)}[args.workload]
    env = cpu_reexec_env() or dict(os.environ)
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / f"{args.workload}.pyspy"
    with running(RADIX, args.model, env, args.out / "radix-mlx.log",
                 shlex.split(args.radix_mlx_args)) as server:
        asyncio.run(run_workload(server.base_url, build_warm_up(args.model, shapes, 0),
                                 RADIX.extra))
        extra = shlex.split(args.py_spy_args)
        # py-spy reads native frames only from a stopped process.
        blocking = [] if "--native" in extra else ["--nonblocking"]
        spy = subprocess.Popen([py_spy, "record", "--pid", str(server.process.pid),
                                "--rate", str(args.rate), "--threads", "--subprocesses",
                                *blocking, "--format", "raw", "-o", str(raw), *extra],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            run = asyncio.run(run_workload(server.base_url, workload, RADIX.extra))
        finally:
            spy.send_signal(signal.SIGINT)
            spy.wait()
    summary = summarize(raw)
    header = f"{args.workload}: {len(run.requests)} requests in {run.wall_seconds:.2f} s\n"
    (args.out / f"{args.workload}.txt").write_text(header + summary)
    print(header + summary)


if __name__ == "__main__":
    main()
