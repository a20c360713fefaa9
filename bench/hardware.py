"""What the benchmark ran on: a short tag for the results folder, and the details.

Never imports MLX (the benchmark process must stay light while servers run); the MLX
device comes from the server logs and `radix-mlx info`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """NVIDIA GPUs by name, empty without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return []
    result = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                            capture_output=True, text=True, check=False)
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def nvidia_smi() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    return subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False).stdout


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def tag(device: str) -> str:
    """e.g. `cpu-amd-epyc-2c` or `nvidia-h100-80gb-hbm3`."""
    if device == "gpu" and gpu_names():
        return slug(gpu_names()[0])
    return f"cpu-{slug(cpu_model())}-{os.cpu_count()}c"


def describe(device: str) -> dict:
    return {
        "tag": tag(device),
        "device": device,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpu_names(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def write_results(out: Path, module: str, device: str, title: str, result: dict,
                  body: Callable[[dict], list[str]], **stamps: object) -> None:
    """A benchmark module's results.json and results.md in `out`: `result` stamped with
    the command that ran it (`python -m module ...`), `stamps` and the hardware; the
    markdown is `title`, the hardware, then `body(stamped result)`."""
    result = {"command": shlex.join(["python", "-m", module, *sys.argv[1:]]), **stamps,
              "hardware": describe(device), **result}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    hw = result["hardware"]
    lines = [f"# {title} on {hw['tag']}", "",
             f"Hardware: {hw['cpu']} ({hw['cpu_count']} cores)"
             + (f", {', '.join(hw['gpus'])}" if hw["gpus"] else "") + f"; device {device}.",
             *body(result), ""]
    (out / "results.md").write_text("\n".join(lines))
