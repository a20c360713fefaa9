"""Where a snapshot model's (Gemma 3 4B-shaped VLM) TTFT goes on the device: bench.vision's
image workload twice on one warm server, with the generator's phases timed
(patch/sitecustomize.py) and, where ptrace is allowed, py-spy sampling the engine.

    python bench/experiments/snapshot-join-4b/run.py OUT [server args...]
"""
import asyncio
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from bench.client import run_workload
from bench.servers import RADIX, running
from bench.vision import BUILD, summarize, workload

out = Path(sys.argv[1]).resolve()
out.mkdir(parents=True, exist_ok=True)
models = Path(os.environ.get("BENCH_MODELS_DIR", "/tmp/bench-models"))
models.mkdir(exist_ok=True)
size = os.environ.get("VISION_SIZE", "4b")
vision = models / f"vision{size}"
if not (vision / "config.json").exists():
    subprocess.run([sys.executable, "-c", BUILD, str(vision), str(models / f"text{size}"), size],
                   check=True)
patch = Path(__file__).parent / "patch"
env = dict(os.environ, STEP_TIMES=str(out / "steps"),
           PYTHONPATH=f"{patch}:{os.environ.get('PYTHONPATH', '')}")
spec = replace(RADIX, args=(*RADIX.args, "--log-level", "debug", *sys.argv[2:]))
with running(spec, vision, env, out / "server.log") as server:
    for seed in (1, 2):
        run = asyncio.run(run_workload(server.base_url, workload(8, 4, 32, True, seed),
                                       RADIX.extra))
        summary = summarize([r.as_dict() for r in run.requests], run.wall_seconds)
        print("pass", seed, {k: v for k, v in summary.items() if k != "requests_detail"},
              flush=True)
