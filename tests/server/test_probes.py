"""/health and /metrics of an app whose engine is still loading (never started here, so
it stays loading): what a load balancer and Prometheus see before the model is ready."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


async def test_health_while_loading_says_so_and_claims_no_progress(loading_app) -> None:
    """There is no honest loading progress to report (mlx-lm loads in one call), so the
    body has none: before, it said 0 until the model was loaded, then 1."""
    health = await loading_app.get("/health")
    assert health.status_code == 503
    assert health.json() == {"status": "loading", "model": "unused", "models": [
        {"id": "unused", "state": "loading", "pinned": True}]}
    head = await loading_app.head("/health")  # a load balancer's probe: the status alone
    assert head.status_code == 503 and not head.content


async def test_the_root_answers_get_and_head(loading_app) -> None:
    """Claude Code sends HEAD / before it starts."""
    assert (await loading_app.head("/")).status_code == 200
    root = await loading_app.get("/")
    assert root.status_code == 200 and "radix-mlx" in root.text


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
