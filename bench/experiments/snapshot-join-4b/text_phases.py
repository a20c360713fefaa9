"""Text-only traffic on the 4B-shaped vision model and on its language model served as
text, each server's generator phases timed (patch/sitecustomize.py): where the vision
model's slower decode comes from, if it is the engine's.

    python bench/experiments/snapshot-join-4b/text_phases.py OUT
"""
import asyncio
import collections
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.client import run_workload
from bench.servers import RADIX, running
from bench.vision import BUILD, summarize, workload

out = Path(sys.argv[1]).resolve()
out.mkdir(parents=True, exist_ok=True)
models = Path(os.environ.get("BENCH_MODELS_DIR", "/tmp/bench-models"))
models.mkdir(exist_ok=True)
size = os.environ.get("VISION_SIZE", "4b")
vision, text = models / f"vision{size}", models / f"text{size}"
if not (vision / "config.json").exists():
    subprocess.run([sys.executable, "-c", BUILD, str(vision), str(text), size], check=True)
patch = Path(__file__).parent / "patch"
for name, model in (("text", text), ("vision", vision), ("text2", text), ("vision2", vision)):
    env = dict(os.environ, STEP_TIMES=str(out / f"steps-{name}"),
               PYTHONPATH=f"{patch}:{os.environ.get('PYTHONPATH', '')}")
    with running(RADIX, model, env, out / f"{name}.log") as server:
        run = asyncio.run(run_workload(server.base_url, workload(8, 4, 32, False, 0),
                                       RADIX.extra))
    summary = summarize([r.as_dict() for r in run.requests], run.wall_seconds)
    times = collections.defaultdict(list)
    for path in out.glob(f"steps-{name}.*"):
        for line in path.read_text().splitlines()[-2000:]:
            fields = line.split()
            rows = fields[4]
            times[(fields[1], rows if fields[1] == "decode" else "")].append(
                float(fields[3].split("=")[1]))
    print(name, {k: round(v, 3) for k, v in summary.items()
                 if k in ("wall_s", "ttft_p50_later_turns", "ttft_p50_first_turn")})
    for key in sorted(times):
        print("   ", key, len(times[key]), "median ms", round(statistics.median(times[key]), 1))
