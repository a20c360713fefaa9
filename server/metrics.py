"""/metrics with prometheus_client: the series the server observes (HTTP requests, time
to first token, time between tokens), the engine's stats read at scrape time by a custom
collector, and the process's own (CPU, memory, open files) from prometheus_client.

The engine's stats describe themselves (radix/stats.py): the collector walks them, so a
new engine or tree counter reaches /metrics without an edit here. Each app has its own
registry, so two apps in one process (tests) do not share series.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import EngineClient, EngineNotReady, EngineStats

if TYPE_CHECKING:
    from server.model_registry import ModelRegistry, ServedModel

log = logging.getLogger("radix_mlx.server")

PREFIX = "radix_mlx"
CONTENT_TYPE = CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

# A `_created` timestamp per counter and histogram doubles the series for no use here.
disable_created_metrics()


def engine_metrics(stats: object) -> Iterator[tuple[str, str, str, float]]:
    """(name, kind, help, value) of every described field of `stats`, nested dataclasses
    included."""
    for item in fields(stats):
        value = getattr(stats, item.name)
        if is_dataclass(value):
            yield from engine_metrics(value)
        elif "kind" in item.metadata:
            meta = item.metadata
            yield meta["name"] or item.name, meta["kind"], meta["help"], value


class ModelsCollector(Collector):
    """Each model's engine stats and lifecycle, labelled by model, read when /metrics is
    scraped, and the registry's own counts: loads, unloads, load seconds, memory shares."""

    def __init__(self, models: ModelRegistry) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        engines = self._models.engines()
        # Read together: each engine process's stats are a round trip, and a hung one's
        # waits out its timeout, which would otherwise add up over the hung ones.
        with ThreadPoolExecutor(max(len(engines), 1)) as pool:
            read = list(pool.map(read_stats, engines))
        for model, stats in read:
            if stats is None:
                continue
            for name, kind, help_text, value in engine_metrics(stats):
                if name not in families:
                    family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    families[name] = family(f"{PREFIX}_{name}", help_text, labels=["model"])
                families[name].add_metric([model.id], value)
        yield from families.values()
        state = GaugeMetricFamily(f"{PREFIX}_model_state", "1 for each model's current "
                                  "lifecycle state.", labels=["model", "state"])
        loads = CounterMetricFamily(f"{PREFIX}_model_loads", "Loads of each model.",
                                    labels=["model"])
        load_seconds = CounterMetricFamily(f"{PREFIX}_model_load_seconds", "Seconds spent "
                                           "loading each model.", labels=["model"])
        unloads = CounterMetricFamily(f"{PREFIX}_model_unloads", "Unloads of each model "
                                      "(idle, to make room, or asked for).", labels=["model"])
        crashes = CounterMetricFamily(f"{PREFIX}_model_crashes", "Engine processes of each "
                                      "model that died while serving.", labels=["model"])
        memory = GaugeMetricFamily(f"{PREFIX}_model_memory_bytes", "Each loaded model's "
                                   "share of the memory budget.", labels=["model"])
        requests = GaugeMetricFamily(f"{PREFIX}_model_requests", "Requests holding each "
                                     "model now, those waiting for its load included.",
                                     labels=["model"])
        guesses = GaugeMetricFamily(f"{PREFIX}_model_next_turn_guesses", "Next-turn guesses "
                                    "of each model waiting to start or computing "
                                    "(server/next_turn.py).", labels=["model"])
        for model in self._models.models:
            engine_state = model.engine.state.value if model.engine else "unloaded"
            state.add_metric([model.id, engine_state], 1)
            loads.add_metric([model.id], model.counters.loads)
            load_seconds.add_metric([model.id], model.counters.load_seconds)
            unloads.add_metric([model.id], model.counters.unloads)
            crashes.add_metric([model.id], model.counters.crashes)
            memory.add_metric([model.id], model.share_bytes if model.engine else 0)
            requests.add_metric([model.id], model.inflight + model.load_waiters)
            guesses.add_metric([model.id], len(model.background))
        yield from (state, loads, load_seconds, unloads, crashes, memory, requests, guesses)


def read_stats(served: tuple[ServedModel, EngineClient]
               ) -> tuple[ServedModel, EngineStats | None]:
    """The engine's stats, or None from a hung or dead engine: a blocking call (a round
    trip to an engine process, as long as CALL_SECONDS for a hung one), so off the loop."""
    model, engine = served
    try:
        return model, engine.stats()
    except (TimeoutError, EngineNotReady) as error:
        # A hung engine process, or one that just died (dropped once the registry sees
        # it): the other models still report.
        log.warning("model %s: no engine stats (%s)", model.id, str(error) or "no answer in time")
        return model, None


class Metrics:
    def __init__(self, models: ModelRegistry) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by endpoint and status.",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "Time between tokens.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.next_turn_tokens = Counter(
            f"{PREFIX}_next_turn_prefilled_tokens", "Tokens of chats' next turns prefilled "
            "after their replies (the reply as the template renders it back).",
            registry=self.registry)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(ModelsCollector(models))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
