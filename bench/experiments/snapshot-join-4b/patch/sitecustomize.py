"""Loaded by every Python process whose PYTHONPATH starts here (the server and its engine
process): times the generator's phases on the device, each call between two
mx.synchronize(), into $STEP_TIMES. Serializes the pipelined decode, so totals grow; the
split is what counts."""
import os
import time

if os.environ.get("STEP_TIMES"):
    import mlx.core as mx

    from engine import generator, scheduler

    out = open(os.environ["STEP_TIMES"] + f".{os.getpid()}", "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def timed(name, function):
        def wrapper(self, *args, **kwargs):
            mx.synchronize()
            start = time.perf_counter()
            result = function(self, *args, **kwargs)
            host = time.perf_counter()
            mx.synchronize()
            end = time.perf_counter()
            rows = len(getattr(self, "rows", ()))
            extra = ""
            if name == "_feed":
                extra = f" fed={result} depth={len(args[0].tokens)} cache={type(args[0].cache[0]).__name__}"
            out.write(f"{time.time():.4f} {name} host={1e3 * (host - start):.1f} "
                      f"total={1e3 * (end - start):.1f} rows={rows} "
                      f"prefilling={len(getattr(self, 'prefilling', ()))} "
                      f"ready={len(getattr(self, 'ready', ()))}{extra}\n")
            return result
        return wrapper

    for name in ("prefill", "decode", "_join", "_enter", "_feed", "_build_cache",
                 "_forward", "_prefill_together", "_feed_together"):
        setattr(generator.Generator, name, timed(name, getattr(generator.Generator, name)))
    scheduler.Scheduler._take_snapshot = timed("_take_snapshot",
                                               scheduler.Scheduler._take_snapshot)
