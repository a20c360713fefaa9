"""Text-only traffic on a vision model against its language model served as text,
alternated (text, vision, text, vision) on one busy machine: bench.vision runs each once,
minutes apart, which the machine's load moved by more than the difference sought.

    python bench/experiments/vision-text-ab/ab.py [OUT_DIR [SIZE [PAIRS]]]

(SIZE: make-demo-model's gemma3-vision size, `bench` by default; `4b` on a GPU.)
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.vision import BUILD, RADIX, TEXT_MODEL, measure, workload
from engine.platform_info import cpu_reexec_env

env = cpu_reexec_env() or dict(os.environ)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/vision-text-ab")
out.mkdir(parents=True, exist_ok=True)
with tempfile.TemporaryDirectory() as directory:
    vision, text = Path(directory) / "vision", Path(directory) / "text"
    size = sys.argv[2] if len(sys.argv) > 2 else "bench"
    subprocess.run([sys.executable, "-c", BUILD, str(vision), str(text), size], env=env,
                   check=True)
    plain = workload(8, 4, 32, False, 0)
    for spec, model in ((TEXT_MODEL, text), (RADIX, vision)) * int(sys.argv[3] if len(sys.argv) > 3 else 2):
        summary = measure(spec, model, plain, env, out)
        print(spec.name, json.dumps({key: value for key, value in summary.items()
                                     if key != "requests_detail"}), flush=True)
