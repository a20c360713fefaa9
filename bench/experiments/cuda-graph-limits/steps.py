"""MLX's CUDA graph limits against decode's host cost: does a step get cheaper when MLX
puts more (or no) kernels into each CUDA graph?

    python bench/experiments/cuda-graph-limits/steps.py MODEL_DIR [--cycles 2]

A 64-stream decode step of the 1B shape is host-bound on an H200: the engine thread's
CPU time per step equals the step (5-11 ms, moving with the host's load), for bare
`BatchGenerator` as for the engine. MLX's CUDA backend records a step's kernels into
CUDA graphs of at most MLX_MAX_OPS_PER_BUFFER nodes (100 on sm_90) and updates a cached
executable graph per commit (MLX_USE_CUDA_GRAPHS=0: plain launches). Each setting runs in
a child process of its own, settings alternating, `--cycles` times: bare `BatchGenerator`
and the engine at 64 streams, then bare `stream_generate` (one stream), three runs each.
One JSON line per child: medians of the step (ms) and of the process's CPU per step.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "default": {},
    "ops 10": {"MLX_MAX_OPS_PER_BUFFER": "10"},
    "ops 20": {"MLX_MAX_OPS_PER_BUFFER": "20"},
    "ops 30": {"MLX_MAX_OPS_PER_BUFFER": "30"},
    "ops 50": {"MLX_MAX_OPS_PER_BUFFER": "50"},
    "ops 300": {"MLX_MAX_OPS_PER_BUFFER": "300"},
    "ops 1000": {"MLX_MAX_OPS_PER_BUFFER": "1000"},
    "no graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}


def child(model: Path) -> dict:
    from mlx_lm import load, stream_generate

    from bench.batch_parity import bare, prompts_for, through_engine
    from engine.engine import Engine, EngineConfig

    lm, tokenizer = load(str(model))
    prompts = prompts_for(64, 64, tokenizer.vocab_size)
    engine = Engine(EngineConfig(model=str(model), max_batch_size=64, disk_cache_bytes=0))
    engine.start()
    if engine.wait_ready() != "ready":
        raise SystemExit(f"the engine did not start: {engine.error}")

    def single() -> tuple[float, float]:
        cpu, times = time.process_time(), []
        for _ in stream_generate(lm, tokenizer, prompts[0], max_tokens=128):
            times.append(time.perf_counter())
        return 1e3 * (times[-1] - times[1]) / (len(times) - 2), (time.process_time() - cpu)

    result: dict = {}
    try:
        for name, run in (("bare_64", lambda: bare(lm, prompts, 128)),
                          ("engine_64", lambda: through_engine(engine, prompts, 128))):
            run()  # kernels, graphs
            steps, cpus = [], []
            for _ in range(3):
                cpu = time.process_time()
                steps.append(run().step_ms())
                cpus.append(1e3 * (time.process_time() - cpu) / 128)
            result[name] = {"step_ms": round(statistics.median(steps), 2),
                            "cpu_ms_per_step": round(statistics.median(cpus), 2),
                            "steps": [round(s, 2) for s in steps]}
        single()
        runs = [single() for _ in range(3)]
        result["bare_1"] = {"step_ms": round(statistics.median(r[0] for r in runs), 3),
                            "cpu_ms_per_step": round(
                                statistics.median(1e3 * r[1] / 128 for r in runs), 3)}
    finally:
        engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model)))
        return
    for cycle in range(args.cycles):
        for name in args.settings.split(","):
            env = {**os.environ, **SETTINGS[name]}
            out = subprocess.run([sys.executable, __file__, str(args.model), "--child"],
                                 env=env, capture_output=True, text=True, check=False)
            line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else None
            print(json.dumps({"cycle": cycle, "setting": name,
                              **(json.loads(line) if line else
                                 {"error": out.stderr[-500:]})}), flush=True)


if __name__ == "__main__":
    main()
