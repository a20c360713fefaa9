"""The batch_decode workload (64 streams, 64-token prompts, 128 tokens out) at seeds 0-3 on
one running server, so each run's prompts are new to it: is the first run slower than the
next ones (shapes the server meets the first time)? Prints a JSON line a run: output
tok/s, client-side send/TTFT/end quantiles, and from LOG (the server's `--log-level debug`
step trace) the steps, their median, the slow ones (rows, ms) and the batch sizes seen.

    python runs_on_one_server.py MODEL URL LOG
"""

import asyncio
import json
import re
import sys
from pathlib import Path

from bench.client import run_workload
from bench.servers import RADIX
from bench.workloads import Shapes, build_all

STEP = re.compile(r"step: (\d+) rows.* ([\d.]+) ms, ")


def quantiles(values: list[float]) -> list[float]:
    values = sorted(values)
    return [round(values[int(p * (len(values) - 1))], 3) for p in (0, .25, .5, .75, 1)]


def main() -> None:
    model, url, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    shapes = Shapes(bd_streams=64, bd_prompt_tokens=64, bd_output_tokens=128)
    for seed in range(4):
        workload = {w.name: w for w in build_all(model, shapes, seed)}["batch_decode"]
        seen = len(log.read_text().splitlines())
        run = asyncio.run(run_workload(url, workload, RADIX.extra))
        requests = run.requests
        steps = [(int(m.group(1)), float(m.group(2)))
                 for line in log.read_text().splitlines()[seen:] if (m := STEP.search(line))]
        print(json.dumps({
            "seed": seed,
            "tok_s": round(sum(r.completion_tokens for r in requests) / run.wall_seconds),
            "wall": round(run.wall_seconds, 3),
            "send": quantiles([r.start for r in requests]),
            "ttft": quantiles([r.ttft for r in requests]),
            "end": quantiles([r.start + r.latency for r in requests]),
            "steps": len(steps),
            "step_ms_p50": sorted(ms for _, ms in steps)[len(steps) // 2] if steps else None,
            "slow_steps": [s for s in steps if s[1] > 15][:12],
            "rows_seen": sorted({rows for rows, _ in steps})}), flush=True)


if __name__ == "__main__":
    main()
