"""Loaded by a server started with this folder on PYTHONPATH: times the parts of each
engine step (decode, ending generations, readouts, prefill, settling KV into the tree,
starting queued requests, and inside prefill the batch cache's build, the forward, the
rows' entry into the batch and the buffer cache's release) and prints the parts of every
step of STEP_PHASES_MIN_MS (default 100) or more to stderr, wall and engine-thread CPU, so
the server log says where a slow step went. Parts nest (prefill holds the forward).

    PYTHONPATH=bench/experiments/step-phases:. python -m server --model M --log-level debug

With STEP_PHASES_SYNC=1 every timed part evaluates the arrays it returns (a forward's
logits, a batch cache's keys and values) and waits for the device before and after it,
so a part is charged the device work it built, not the part that happened to evaluate it.
With STEP_PHASES_NO_CLEAR=1 `mx.clear_cache` does nothing (an experiment: what the engine's
releases of MLX's buffer cache cost the steps after them).

Wraps the methods once the engine's modules are imported (an import hook), and changes
nothing they compute."""

import os
import sys
import threading
import time
from importlib.abc import MetaPathFinder

PHASES = {
    "engine.scheduler": {"Scheduler": ("_end", "_read", "_take_inbox", "_try_start", "_deliver")},
    "engine.generator": {"Generator": ("decode", "prefill", "_forward_rows", "_run", "_enter",
                                       "_join", "_feed", "_background_together")},
    "engine.kv": {"KVStore": ("settle",)},
}
# Module-level functions, wrapped where the generator looks them up.
FUNCTIONS = {"engine.generator": ("prefix_batch",)}
MIN_SECONDS = float(os.environ.get("STEP_PHASES_MIN_MS", "100")) / 1e3
SYNC = os.environ.get("STEP_PHASES_SYNC") == "1"
NO_CLEAR = os.environ.get("STEP_PHASES_NO_CLEAR") == "1"
_parts = threading.local()


def _arrays(value, depth=0):
    """The MLX arrays in a part's result: arrays, in lists and tuples, and caches' keys and
    values."""
    import mlx.core as mx
    if isinstance(value, mx.array):
        return [value]
    if depth > 2:
        return []
    if isinstance(value, (list, tuple)):
        return [a for item in value for a in _arrays(item, depth + 1)]
    return [a for name in ("keys", "values") if isinstance(a := getattr(value, name, None), mx.array)]


def _timed(name, method):
    def wrapper(*args, **kwargs):
        if SYNC:
            import mlx.core as mx
            mx.synchronize()
        wall, cpu = time.perf_counter(), time.thread_time()
        result = None
        try:
            result = method(*args, **kwargs)
            return result
        finally:
            if SYNC:
                mx.eval(_arrays(result))
                mx.synchronize()
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
            if total >= MIN_SECONDS:
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
    for name in FUNCTIONS.get(module.__name__, ()):
        setattr(module, name, _timed(name, getattr(module, name)))
    if module.__name__ == "engine.generator":
        import mlx.core as mx
        if not hasattr(mx.clear_cache, "__wrapped__"):
            timed = _timed("mx.clear_cache", (lambda: None) if NO_CLEAR else mx.clear_cache)
            timed.__wrapped__ = mx.clear_cache
            mx.clear_cache = timed
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
