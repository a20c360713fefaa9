"""Load with faults: dozens of concurrent clients mixing whole and streamed requests with
disconnects, malformed, oversized and unauthorized bodies, requests beyond the context
and failing forward passes. Afterwards the server must be as if nothing had happened:
every good request answered correctly, nothing running or pinned, the tree within its
budget and MLX's memory back near where it started."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engine.demo_model import MAX_POSITION_EMBEDDINGS
from tests.reliability.storm import (
    MEMORY_SLACK,
    Tally,
    Workload,
    baseline,
    rerun_alone,
    storm,
)
from tests.reliability.support import AUTH, CACHE_BYTES, fault_token
from tests.server.support import ServerProcess, wait_idle

REQUESTS = 240
CONCURRENCY = 48


@dataclass
class Storm:
    tally: Tally
    before: dict[str, float]  # /metrics after warm-up and one request
    after: dict[str, float]  # /metrics once the storm's requests have all ended


@pytest.fixture(scope="module")
def stormed(hardened: ServerProcess, demo_model_dir: Path) -> Storm:
    workload = Workload(seed=0, fault=fault_token(demo_model_dir),
                        context=MAX_POSITION_EMBEDDINGS)
    before = baseline(hardened)
    tally = asyncio.run(storm(hardened.url, workload.specs(REQUESTS), CONCURRENCY))
    return Storm(tally, before, wait_idle(hardened))


def test_every_request_gets_an_answer_its_kind_allows(stormed: Storm) -> None:
    """Good requests: 200 with a finish reason (or a whole 429); bad ones: their 4xx; a
    failing forward: a 500 (or a stream's error event); no transport errors."""
    assert not stormed.tally.unexpected, "\n".join(stormed.tally.unexpected)
    assert sum(stormed.tally.sent.values()) == REQUESTS
    assert stormed.tally.disconnects > 0 and stormed.tally.failures_survived > 0


def test_nothing_runs_or_stays_pinned_and_the_tree_keeps_its_budget(stormed: Storm) -> None:
    after = stormed.after
    assert after["radix_mlx_running_requests"] == after["radix_mlx_queue_depth"] == 0
    assert after["radix_mlx_tree_pinned_bytes"] == after["radix_mlx_tree_pending_nodes"] == 0
    assert after["radix_mlx_tree_capacity_bytes"] == CACHE_BYTES
    assert after["radix_mlx_tree_bytes"] <= CACHE_BYTES
    assert after["radix_mlx_tree_evictions_total"] > 0  # the budget was really in play


def test_mlx_memory_returns_near_its_baseline(stormed: Storm) -> None:
    before = stormed.before["radix_mlx_active_memory_bytes"]
    assert stormed.after["radix_mlx_active_memory_bytes"] <= before + MEMORY_SLACK


def test_repeatable_answers_equal_the_same_requests_run_alone(
    stormed: Storm, hardened: ServerProcess
) -> None:
    """Greedy and seeded requests, with and without penalties, answer in the storm (in
    batches with any neighbours, their prefixes evicted and cached again) as alone."""
    assert len(stormed.tally.repeatable) > 10
    assert asyncio.run(rerun_alone(hardened.url, stormed.tally)) == []


def test_the_server_still_answers(hardened: ServerProcess) -> None:
    assert httpx.get(f"{hardened.url}/health", timeout=30).json()["status"] == "ready"
    response = httpx.get(f"{hardened.url}/v1/models", headers=AUTH, timeout=30)
    assert response.status_code == 200
