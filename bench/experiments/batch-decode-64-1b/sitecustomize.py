"""Loaded by every Python process started with this folder on PYTHONPATH (the server
under test): prints each garbage collection of 1 ms or more, with its generation, to
stderr, so a pause shows in the server log between the scheduler's step lines."""

import gc
import sys
import time

_started = {}


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started["t"] = time.perf_counter()
        return
    ms = 1e3 * (time.perf_counter() - _started.get("t", time.perf_counter()))
    if ms >= 1.0:
        print(f"gc: generation {info['generation']}, {ms:.1f} ms, {info['collected']} "
              f"collected, {len(gc.get_objects())} objects", file=sys.stderr, flush=True)


gc.callbacks.append(_timed)
