"""Loaded by a server started with this folder on PYTHONPATH: times the parts of each
engine step (decode, ending generations, readouts, prefill, settling KV into the tree,
starting queued requests) and prints the parts of every step of 100 ms or more to stderr,
wall and engine-thread CPU, so the server log says where a slow step went.

    PYTHONPATH=bench/experiments/step-phases:. python -m server --model M --log-level debug

Wraps the methods once the engine's modules are imported (an import hook), and changes
nothing they compute."""

import sys
import threading
import time
from importlib.abc import MetaPathFinder

PHASES = {
    "engine.scheduler": {"Scheduler": ("_end", "_read", "_take_inbox", "_try_start", "_deliver")},
    "engine.generator": {"Generator": ("decode", "prefill")},
    "engine.kv": {"KVStore": ("settle",)},
}
_parts = threading.local()


def _timed(name, method):
    def wrapper(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            parts = getattr(_parts, "d", None)
            if parts is not None:
                w, c = parts.get(name, (0.0, 0.0))
                parts[name] = (w + time.perf_counter() - wall, c + time.thread_time() - cpu)
    return wrapper


def _step_timed(method):
    def wrapper(self, *args, **kwargs):
        _parts.d = {}
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            total = time.perf_counter() - wall
            if total >= 0.1:
                parts = ", ".join(f"{k} {1e3 * w:.0f}/{1e3 * c:.0f}"
                                  for k, (w, c) in sorted(_parts.d.items(), key=lambda i: -i[1][0]))
                print(f"slow step {1e3 * total:.0f} ms ({1e3 * (time.thread_time() - cpu):.0f} "
                      f"CPU): {parts}", file=sys.stderr, flush=True)
            _parts.d = None
    return wrapper


def _patch(module) -> None:
    for cls_name, methods in PHASES.get(module.__name__, {}).items():
        cls = getattr(module, cls_name, None)
        if cls is None:
            continue
        for name in methods:
            if hasattr(cls, name):
                setattr(cls, name, _timed(f"{cls_name}.{name}", getattr(cls, name)))
    if module.__name__ == "engine.scheduler":
        module.Scheduler._step = _step_timed(module.Scheduler._step)


class _Hook(MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in PHASES:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _patch(module)
        loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
