"""Batch decode at 64 streams through radix-mlx's server, step by step: where does the
workload's time go between bare BatchGenerator's ~1.0 s and the server's ~1.4 s?

    python bench/experiments/batch-decode-64-1b/steps.py MODEL_DIR OUT [--repeats 2]

For each server setting (below), one server with `--log-level debug` (the scheduler logs
every step: rows, prompt tokens fed, prompts left, wall ms), and alternating runs of
  chat:  the benchmark's batch_decode workload (bench/client.py, chat completions, 64
         streams of 64-token prompts, 128 tokens each),
  ids:   bench/batch_parity's HTTP path (/v1/completions on token ids, no JSON parsing),
each run's slice of the step log summarized: steps, steps until all 64 rows decode (the
ramp) and its length, the decode steps' median with all 64 rows, the tokens' wall time.
"""

import argparse
import asyncio
import json
import os
import re
import statistics
import time
from pathlib import Path

from mlx_lm import load

from bench.batch_parity import prompts_for, through_server
from bench.client import run_workload
from bench.servers import RADIX, running
from bench.workloads import Shapes, build_all, build_warm_up

SETTINGS = {
    "default": [],
    "prefill-batch-64": ["--prefill-batch-size", "64"],
    "engine-process": ["--engine-process", "true"],
}
STEP = re.compile(r"step: (\d+) rows(?: \(\d+ verified\))?, (\d+) prompt tokens fed, "
                  r"(\d+) prompts left, ([\d.]+) ms")
SHAPES = Shapes(bd_streams=64, bd_prompt_tokens=64, bd_output_tokens=128)


def steps_in(log: Path, start: int) -> list[tuple[int, int, int, float]]:
    text = log.read_text(errors="replace")[start:]
    return [(int(a), int(b), int(c), float(d)) for a, b, c, d in STEP.findall(text)]


def summarize(steps: list[tuple[int, int, int, float]], streams: int) -> dict:
    full = next((i for i, s in enumerate(steps) if s[0] == streams and s[1] == 0), len(steps))
    decode = [s[3] for s in steps[full:] if s[0] == streams and s[1] == 0]
    return {"steps": len(steps), "ramp_steps": full,
            "ramp_ms": round(sum(s[3] for s in steps[:full]), 1),
            "ramp_prefill_steps": sum(1 for s in steps[:full] if s[1]),
            "decode_step_ms_p50": round(statistics.median(decode), 2) if decode else None,
            "decode_step_ms_mean": round(statistics.fmean(decode), 2) if decode else None,
            "decode_step_ms_max": max(decode, default=None),
            "decode_steps": len(decode),
            "all_steps_ms": round(sum(s[3] for s in steps), 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    _, tokenizer = load(str(args.model), lazy=True)
    ids = prompts_for(64, 64, tokenizer.vocab_size)
    chat = next(w for w in build_all(args.model, SHAPES, 0) if w.name == "batch_decode")
    rows = []
    for name, extra in SETTINGS.items():
        log = args.out / f"{name}.log"
        flags = ["--max-batch-size", "64", "--log-level", "debug", *extra]
        with running(RADIX, args.model, dict(os.environ), log, flags) as server:
            asyncio.run(run_workload(server.base_url, build_warm_up(args.model, SHAPES, 0),
                                     RADIX.extra))
            through_server(server.base_url, ids, 128)
            for repeat in range(args.repeats):
                for path in ("chat", "ids"):
                    time.sleep(0.5)  # the last run's final steps logged
                    start = log.stat().st_size
                    began = time.perf_counter()
                    if path == "chat":
                        run = asyncio.run(run_workload(server.base_url, chat, RADIX.extra))
                        tokens = sum(r.completion_tokens for r in run.requests)
                    else:
                        tokens = sum(map(len, through_server(server.base_url, ids, 128).times))
                    wall = time.perf_counter() - began
                    time.sleep(0.5)
                    row = {"setting": name, "path": path, "repeat": repeat,
                           "wall_s": round(wall, 3), "tok_s": round(tokens / wall),
                           **summarize(steps_in(log, start), 64)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    (args.out / "steps.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
