"""Measurements that run in a child process of their own (a bare baseline, a peer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def child_json(module: str, model: Path, env: dict[str, str], *args: object) -> dict:
    """Run `python -m module MODEL args...` and read the JSON object it prints last."""
    argv = [sys.executable, "-m", module, str(model), *map(str, args)]
    result = subprocess.run(argv, check=False, env=env, capture_output=True, text=True)
    if result.returncode != 0:  # its traceback is the useful part of the failure
        sys.stderr.write(result.stderr)
        result.check_returncode()
    return json.loads(result.stdout.strip().splitlines()[-1])
