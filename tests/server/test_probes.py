"""/health and /metrics of an app whose engine is still loading (never started here, so
it stays loading): what a load balancer and Prometheus see before the model is ready."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from engine.api import EngineStats, Lifecycle
from server.metrics import ModelsCollector
from server.model_registry import ModelCounters


async def test_health_while_loading_says_so_and_claims_no_progress(loading_app) -> None:
    """There is no honest loading progress to report (mlx-lm loads in one call), so the
    body has none: before, it said 0 until the model was loaded, then 1."""
    health = await loading_app.get("/health")
    assert health.status_code == 503
    assert health.json() == {"status": "loading", "model": "unused", "models": [
        {"id": "unused", "state": "loading", "pinned": True}]}
    head = await loading_app.head("/health")  # a load balancer's probe: the status alone
    assert head.status_code == 503 and not head.content


async def test_a_request_while_loading_is_told_when_to_come_back(loading_app) -> None:
    """503 in the API's shape with Retry-After, which the OpenAI SDKs wait out before
    their retry."""
    reply = await loading_app.post("/v1/chat/completions", json={
        "model": "unused", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 503 and int(reply.headers["retry-after"]) > 0
    assert reply.json()["error"]["code"] == "model_not_ready"
    assert reply.json()["error"]["message"] == "the model is loading"


async def test_the_root_answers_get_and_head_as_ollama(loading_app) -> None:
    """Claude Code sends HEAD / before it starts; clients built for Ollama GET / and
    compare the body with Ollama's own, whole ("Ollama is running")."""
    assert (await loading_app.head("/")).status_code == 200
    root = await loading_app.get("/")
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert root.headers["content-type"].startswith("text/plain")


async def test_metrics_parse_and_hold_engine_tree_and_process_series(loading_app) -> None:
    response = await loading_app.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    state = families["radix_mlx_model_state"].samples
    assert [(s.labels, s.value) for s in state] == [
        ({"model": "unused", "state": "loading"}, 1.0)]
    assert families["radix_mlx_generated_tokens"].type == "counter"
    assert families["radix_mlx_tree_pinned_bytes"].type == "gauge"
    assert families["radix_mlx_time_to_first_token_seconds"].type == "histogram"
    assert "process_resident_memory_bytes" in families
    assert "radix_mlx_model_load_progress" not in families


def test_a_scrape_asks_every_engine_at_once() -> None:
    """Each engine process's stats are a round trip, which a hung one waits out: asked one
    after another, every hung engine added its timeout to the scrape. These engines
    answer only once both have been asked."""
    both_asked = threading.Barrier(2, timeout=30)

    class Engine:
        state = Lifecycle.READY

        def stats(self) -> EngineStats:
            both_asked.wait()
            return EngineStats()

    models = [SimpleNamespace(id=name, engine=Engine(), counters=ModelCounters(),
                              share_bytes=0, inflight=0, load_waiters=0, background=set())
              for name in ("first", "second")]
    registry = SimpleNamespace(models=models,
                               engines=lambda: [(model, model.engine) for model in models])
    families = {family.name: family for family in ModelsCollector(registry).collect()}
    assert [sample.labels for sample in families["radix_mlx_generated_tokens"].samples] == [
        {"model": "first"}, {"model": "second"}]
