"""Batch decode at 64 streams on a fresh radix-mlx server, then again after the
benchmark's other workloads (as `bench/gpu.sh` runs them on one server start): is the
slower decode in the benchmark's run the server's state after those workloads?

    python bench/experiments/batch-decode-64-1b/sequence.py MODEL_DIR OUT [ORDER]

One server with `--log-level debug` (a line per scheduler step) and this folder's
sitecustomize.py (a line per garbage collection of >= 1 ms). Runs: batch_decode, then
shared_prefix, multi_turn, no_share, long_context at gpu.sh's sizes, then batch_decode
twice, or the comma-separated workloads of ORDER (each earlier workload alone between
batch_decode runs finds which one leaves decode slower). Per batch_decode run: the client's figures (tok/s, TTFT and ITL p50), the steps
(steps.py's summary) and the collections in that run's slice of the log; after every run,
the server's radix_mlx_* cache gauges.
"""

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import httpx
from steps import steps_in, summarize

from bench import report
from bench.client import run_workload
from bench.servers import RADIX, running
from bench.workloads import Shapes, build_all, build_warm_up

GPU_SIZES = Shapes(sp_groups=8, sp_prompts_per_group=4, sp_system_tokens=2000,
                   sp_question_tokens=64, sp_output_tokens=64, sp_concurrency=16,
                   mt_conversations=8, mt_turns=4, mt_system_tokens=1000,
                   mt_user_tokens=200, mt_output_tokens=64, ns_prompts=32,
                   ns_prompt_tokens=1000, ns_output_tokens=64, ns_concurrency=16,
                   lc_document_tokens=6000, lc_questions=4, lc_question_tokens=64,
                   lc_output_tokens=32, bd_streams=64, bd_prompt_tokens=64,
                   bd_output_tokens=128)
ORDER = ["batch_decode", "shared_prefix", "multi_turn", "no_share", "long_context",
         "batch_decode", "batch_decode"]
GC = re.compile(r"gc: generation (\d), ([\d.]+) ms")


def main() -> None:
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    order = sys.argv[3].split(",") if len(sys.argv) > 3 else ORDER
    out.mkdir(parents=True, exist_ok=True)
    log = out / "server.log"
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    workloads = {w.name: w for w in build_all(model, GPU_SIZES, 0)}
    flags = ["--max-batch-size", "64", "--log-level", "debug"]
    rows = []
    with running(RADIX, model, env, log, flags) as server:
        asyncio.run(run_workload(server.base_url, build_warm_up(model, GPU_SIZES, 0),
                                 RADIX.extra))
        for index, name in enumerate(order):
            start = log.stat().st_size
            run = asyncio.run(run_workload(server.base_url, workloads[name], RADIX.extra))
            summary = report.summarize(run, 0, None)
            text = log.read_text(errors="replace")[start:]
            pauses = [(int(g), float(ms)) for g, ms in GC.findall(text)]
            gauges = {line.split()[0]: float(line.split()[1])
                      for line in httpx.get(f"{server.base_url}/metrics").text.splitlines()
                      if line.startswith("radix_mlx_") and " " in line
                      and not line.startswith("#") and "{" not in line.split()[0]}
            row = {"index": index, "workload": name,
                   **{k: summary[k] for k in ("output_tok_s", "ttft_p50", "itl_p50",
                                              "wall_seconds")},
                   "gc_pauses": len(pauses), "gc_ms": round(sum(ms for _, ms in pauses), 1),
                   "gc_max_ms": max((ms for _, ms in pauses), default=0.0),
                   "gc_gen2": sum(1 for g, _ in pauses if g == 2),
                   **(summarize(steps_in(log, start), 64) if name == "batch_decode" else {}),
                   "gauges": {k: v for k, v in gauges.items()
                              if any(w in k for w in ("cache", "node", "active", "token"))}}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "gauges"}), flush=True)
    (out / "sequence.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
