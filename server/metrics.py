"""Prometheus text exposition, by hand: a few counters and histograms the server
observes, plus the engine's own counters and gauges read at scrape time.

Everything is touched from the event loop only, so no locking is needed.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator
from dataclasses import fields, is_dataclass

from engine.api import EngineStats

PREFIX = "radix_mlx"



def engine_metrics(stats: object) -> Iterator[tuple[str, str, str, float]]:
    """(name, kind, help, value) of every described field of `stats`, nested dataclasses
    included: the stats dataclasses say themselves what they export (radix/stats.py)."""
    for item in fields(stats):
        value = getattr(stats, item.name)
        if is_dataclass(value):
            yield from engine_metrics(value)
        elif "kind" in item.metadata:
            meta = item.metadata
            yield meta["name"] or item.name, meta["kind"], meta["help"], value


TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = f"{PREFIX}_{name}", help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {cumulative}"]
        return lines


class Metrics:
    """The server-side series; `render` adds the engine's at scrape time."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def render(self, stats: EngineStats, state: str, load_progress: float) -> str:
        name = f"{PREFIX}_http_requests_total"
        lines = [f"# HELP {name} HTTP requests by endpoint and status.", f"# TYPE {name} counter"]
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(f'{name}{{endpoint="{endpoint}",status="{status}"}} {count}')
        lines += self.ttft.render() + self.itl.render()
        for metric, kind, help_text, value in engine_metrics(stats):
            metric = f"{PREFIX}_{metric}{'_total' if kind == 'counter' else ''}"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {value}"]
        name = f"{PREFIX}_model_state"
        lines += [f"# HELP {name} 1 for the engine's current lifecycle state.",
                  f"# TYPE {name} gauge", f'{name}{{state="{state}"}} 1']
        name = f"{PREFIX}_model_load_progress"
        lines += [f"# HELP {name} Model loading progress, 0 to 1.",
                  f"# TYPE {name} gauge", f"{name} {load_progress}"]
        return "\n".join(lines) + "\n"

