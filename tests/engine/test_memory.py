"""The memory plan: weights + prefix cache + headroom + running KV under one limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.memory import (
    BASE_HEADROOM_BYTES,
    MIN_CACHE_BYTES,
    MemoryPlanError,
    describe,
    documented_table,
    headroom,
    plan_memory,
)

GIB = 2**30
DOCS = Path(__file__).resolve().parents[2] / "docs" / "memory.md"


def test_the_kv_gets_what_weights_cache_and_headroom_leave() -> None:
    plan = plan_memory(limit_bytes=48 * GIB, weight_bytes=4 * GIB, kv_bytes_per_token=1024,
                       headroom_bytes=2 * GIB, cache_bytes=10 * GIB)
    assert plan.kv_bytes == 32 * GIB
    assert plan.kv_tokens == 32 * GIB // 1024


def test_a_quantized_cache_holds_more_tokens_in_the_same_budget() -> None:
    """--kv-bits 8 on a bfloat16 model of head dimension 64: 1 byte a value plus a float32
    scale and bias per 64 values, 1.125 bytes against 2. The running KV keeps its size."""
    options = {"limit_bytes": 48 * GIB, "weight_bytes": 4 * GIB, "kv_bytes_per_token": 2048,
               "headroom_bytes": 2 * GIB, "cache_bytes": 10 * GIB}
    plain = plan_memory(**options)
    quantized = plan_memory(**options, cached_bytes_per_token=1152)
    assert plain.cached_tokens == 10 * GIB // 2048
    assert quantized.cached_tokens == 10 * GIB // 1152
    assert quantized.cached_tokens / plain.cached_tokens == pytest.approx(1.78, abs=0.01)
    assert quantized.kv_tokens == plain.kv_tokens
    assert f"({quantized.cached_tokens} tokens at 1152 B/token)" in describe(quantized)


def test_the_cache_takes_its_fraction_of_the_limit_less_the_weights() -> None:
    plan = plan_memory(limit_bytes=40 * GIB, weight_bytes=4 * GIB, kv_bytes_per_token=1024,
                       headroom_bytes=GIB, cache_fraction=0.25)
    assert plan.cache_bytes == 6 * GIB
    assert plan.kv_bytes == 29 * GIB


def test_big_weights_leave_the_cache_its_minimum() -> None:
    plan = plan_memory(limit_bytes=48 * GIB, weight_bytes=40 * GIB, kv_bytes_per_token=1024,
                       headroom_bytes=GIB)
    assert plan.cache_bytes == MIN_CACHE_BYTES
    assert plan.kv_bytes == 7 * GIB - MIN_CACHE_BYTES


def test_a_model_that_leaves_no_room_for_kv_is_refused_with_the_numbers() -> None:
    with pytest.raises(MemoryPlanError, match=r"weights take 47\.0 GiB"):
        plan_memory(limit_bytes=48 * GIB, weight_bytes=47 * GIB, kv_bytes_per_token=1024,
                    headroom_bytes=GIB)


def test_headroom_grows_with_the_prefill_chunk_and_the_vocabulary() -> None:
    assert headroom(2048, 128256, 1024, 0) == BASE_HEADROOM_BYTES + 8 * 2048 * 128256
    assert headroom(512, 2048, 1024, 0) < headroom(2048, 2048, 1024, 0) < headroom(
        2048, 128256, 1024, 0)


def test_headroom_holds_a_verify_steps_extra_positions() -> None:
    """32 rows padded to a draft of 8 hold 256 positions of KV more for the step."""
    assert (headroom(2048, 2048, 131072, 32 * 8) - headroom(2048, 2048, 131072, 0)
            == 32 * 8 * 131072)


def test_the_documented_mac_studio_table_is_what_the_code_computes() -> None:
    assert documented_table() in DOCS.read_text()
