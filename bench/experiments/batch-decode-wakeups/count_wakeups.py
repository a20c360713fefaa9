"""Count the asyncio loop wake-ups from other threads, and the engine's steps, in a run of
`bench.batch_parity` (its arguments follow): `python count_wakeups.py DIR --streams 64 ...`."""

import asyncio
import atexit
import runpy
import sys
import threading

from engine import scheduler

counts = {"wake-ups": 0, "steps": 0}
call_soon_threadsafe = asyncio.BaseEventLoop.call_soon_threadsafe
step = scheduler.Scheduler._step


def counted_wake_up(loop, *args, **kwargs):
    if threading.current_thread() is not threading.main_thread():
        counts["wake-ups"] += 1
    return call_soon_threadsafe(loop, *args, **kwargs)


def counted_step(self):
    counts["steps"] += 1
    return step(self)


asyncio.BaseEventLoop.call_soon_threadsafe = counted_wake_up
scheduler.Scheduler._step = counted_step
atexit.register(lambda: print("COUNTS", counts, file=sys.stderr))
sys.argv = ["batch_parity", *sys.argv[1:]]
runpy.run_module("bench.batch_parity", run_name="__main__")
