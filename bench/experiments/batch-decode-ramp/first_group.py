"""Where the first 64 streams' ramp goes: the batch_decode workload (64 chat streams,
64-token prompts, 128 tokens out) at seeds 0-2 on one running server, each run's client
times (send, first token) beside the server's step trace (`--log-level debug`) on one
clock. Prints a JSON line a run: output tok/s, the sends' span, the first tokens in
groups, and the steps of the first 0.8 s (start, rows, prompt tokens fed, ms, CPU ms).

    python first_group.py MODEL URL LOG
"""

import asyncio
import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

from bench.client import run_workload
from bench.servers import RADIX
from bench.workloads import Shapes, build_all

STEP = re.compile(r"^(\S+ \S+) DEBUG.*step: (\d+) rows.*, (\d+) prompt tokens fed, "
                  r"(\d+) prompts left, ([\d.]+) ms, ([\d.]+) ms CPU")


def steps_after(log: Path, seen: int, t0: float) -> list[tuple]:
    """(start s after t0, rows, prompt tokens fed, ms, CPU ms) of the log's new steps."""
    out = []
    for line in log.read_text().splitlines()[seen:]:
        if m := STEP.search(line):
            end = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            ms = float(m.group(5))
            out.append((round(end - ms / 1e3 - t0, 3), int(m.group(2)), int(m.group(3)),
                        ms, float(m.group(6))))
    return out


def main() -> None:
    model, url, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    shapes = Shapes(bd_streams=64, bd_prompt_tokens=64, bd_output_tokens=128)
    for seed in range(3):
        workload = {w.name: w for w in build_all(model, shapes, seed)}["batch_decode"]
        seen = len(log.read_text().splitlines())
        t0 = time.time()
        run = asyncio.run(run_workload(url, workload, RADIX.extra))
        time.sleep(0.5)  # the log's last lines
        requests = run.requests
        firsts = sorted(round(r.start + r.ttft, 3) for r in requests)
        print(json.dumps({
            "seed": seed,
            "tok_s": round(sum(r.completion_tokens for r in requests) / run.wall_seconds),
            "wall": round(run.wall_seconds, 3),
            "sends": [round(min(r.start for r in requests), 3),
                      round(max(r.start for r in requests), 3)],
            "first_tokens": firsts[::8] + firsts[-1:],
            "end": round(max(r.start + r.latency for r in requests), 3),
            "ramp_steps": [s for s in steps_after(log, seen, t0) if s[0] < 0.8]}),
            flush=True)


if __name__ == "__main__":
    main()
