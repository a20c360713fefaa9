"""Loaded by a server started with this folder on PYTHONPATH: counts the primitives MLX
will run for each evaluation inside the engine's prompt steps (`Generator._feed`,
`_prefill_together`, `_feed_together`, `_background_together`, `_join`), by kind, and
prints one line per evaluation to stderr. On a GPU each primitive is a kernel launch or
more (a concatenate launches a copy per input), so the count says how much host work a
step's graph asks for, the same on any device.

    PYTHONPATH=bench/experiments/prefill-graph-size:. python -m server --model M \
      --log-level debug

Changes nothing the engine computes."""

import sys

import mlx.core as mx
from graph_count import line, primitives

CALLERS = {"_feed", "_prefill_together", "_feed_together", "_background_together", "_join"}
_eval = mx.eval


def _counted(*args):
    frame, caller = sys._getframe(1), None
    for _ in range(4):
        if frame is None:
            break
        if frame.f_code.co_name in CALLERS:
            caller = frame.f_code.co_name
            break
        frame = frame.f_back
    if caller is not None:
        print("graph " + line(caller, primitives(args)), file=sys.stderr, flush=True)
    return _eval(*args)


mx.eval = _counted
