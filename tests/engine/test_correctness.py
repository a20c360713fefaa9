"""Greedy output is token-identical to mlx-lm's, whatever the radix cache did.

Run for a plain-KV family (llama), a sliding-window family (gemma3_text: rotating and
plain caches) and a hybrid recurrent family (qwen3_next: arrays and plain caches).
"""

from __future__ import annotations

import asyncio
import gc

from engine.api import Finish, Prompt, SamplingParams
from tests.engine.kv_integrity import check_tree_kv
from tests.engine.support import complete, settled, start_engine
from tests.faults import PrefillWatcher, loader_wrapping

pytestmark = __import__("pytest").mark.asyncio(loop_scope="module")


def encode(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, special_tokens=False)


async def test_cold_cache(engine, reference):
    prompt = encode(engine, "A cold prompt about rivers, valleys and the sea. " * 3)
    result = await complete(engine, prompt, 24)
    assert result.tokens == reference.greedy(prompt, 24)
    assert result.finish.cached_tokens == 0


async def test_full_hit_reuses_all_but_the_last_prompt_token(engine, reference):
    prompt = encode(engine, "The same question, asked twice, about lighthouses. " * 3)
    first = await complete(engine, prompt, 24)
    second = await complete(engine, prompt, 24)
    assert first.tokens == second.tokens == reference.greedy(prompt, 24)
    assert second.finish.cached_tokens == len(prompt) - 1


async def test_partial_hit_splits_a_node(engine, reference):
    shared = encode(engine, "Shared system prompt: you answer briefly and kindly. " * 2)
    first = shared + encode(engine, " What is a comet?")
    second = shared + encode(engine, " Why is the sky blue?")
    await complete(engine, first, 8)
    before = engine.stats()
    result = await complete(engine, second, 24)
    assert result.tokens == reference.greedy(second, 24)
    if engine_segments(engine):
        # Plain KV splits the first prompt's node at the shared boundary.
        assert result.finish.cached_tokens >= len(shared) - 1
        assert engine.stats().tree.nodes > before.tree.nodes
    else:
        # Snapshots only reuse whole nodes; the shared head was never a node end.
        assert result.finish.cached_tokens == 0


async def test_message_ends_are_shared_by_another_conversation(engine, reference):
    system = encode(engine, "System: you answer tersely, about tides and the moon. " * 2)
    turn = system + encode(engine, " User: what is a neap tide?")
    first = turn + encode(engine, " Assistant: a small one. User: and a spring tide?")
    await complete(engine, Prompt(first, (len(system), len(turn))), 8)
    # Another conversation with the same system prompt reuses it, even where the cache
    # is only reusable as whole-state snapshots: prefill took one at the message end.
    second = system + encode(engine, " User: why is the moon red tonight?")
    result = await complete(engine, Prompt(second, (len(system),)), 24)
    assert result.tokens == reference.greedy(second, 24)
    assert result.finish.cached_tokens >= len(system)
    # And a retry of the first conversation's last turn, its earlier turn.
    retry = turn + encode(engine, " Assistant: a weak one. User: and a king tide?")
    result = await complete(engine, Prompt(retry, (len(system), len(turn))), 24)
    assert result.tokens == reference.greedy(retry, 24)
    assert result.finish.cached_tokens >= len(turn)


async def test_generated_tokens_are_cached_for_the_next_turn(engine, reference):
    prompt = encode(engine, "Turn one of a conversation about gardens. ")
    first = await complete(engine, prompt, 12, ignore_eos=True)
    follow_up = prompt + first.tokens + encode(engine, " And turn two?")
    result = await complete(engine, follow_up, 12)
    assert result.tokens == reference.greedy(follow_up, 12)
    assert result.finish.cached_tokens >= len(prompt) + len(first.tokens) - 1


async def test_batched_beside_requests_of_other_lengths(engine, reference):
    prompts = [encode(engine, text) for text in (
        "x",
        "A medium length prompt about trains and stations.",
        "A much longer prompt that goes on about mountains, glaciers and weather. " * 6,
        "Another one, about music.",
        "A much longer prompt that goes on about mountains, glaciers and weather. " * 3,
    )]
    results = await asyncio.gather(*(complete(engine, p, 20) for p in prompts))
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference.greedy(prompt, 20)


async def test_n_copies_share_one_prefill(engine, reference):
    prompt = encode(engine, "Four samples of one brand new prompt about owls. " * 4)
    before = engine.stats().counters.prefill_tokens
    results = await asyncio.gather(*(complete(engine, prompt, 16) for _ in range(4)))
    expected = reference.greedy(prompt, 16)
    assert all(r.tokens == expected for r in results)
    # The prompt is computed once; each other copy only runs its last token.
    assert engine.stats().counters.prefill_tokens - before == len(prompt) + 3


async def test_a_prefill_cancelled_midway_keeps_its_computed_chunks(
        family, family_model_dir, reference, monkeypatch):
    """A client that gives up during a long prefill and sends the prompt again (Claude
    Code timing out on a slow CPU): the retry reuses the chunks computed before the
    cancel, and answers as a run with no cache does."""
    watcher = PrefillWatcher()
    monkeypatch.setattr("engine.engine.load_model", loader_wrapping(watcher.around))
    engine = start_engine(family_model_dir(family), cache_bytes=1 << 30,
                          prefill_chunk_tokens=32)
    try:
        prompt = encode(engine, "A long document about canals, locks and barges. " * 20)
        assert len(prompt) > 200
        # Three chunks in, the client goes: the cancel is taken before the fourth.
        watcher.watch(96, lambda: engine.cancel("gave-up"))
        stream = engine.submit(prompt, SamplingParams(max_tokens=16, temperature=0.0),
                               request_id="gave-up")
        events = [event async for event in stream]
        assert [type(e) for e in events] == [Finish] and events[0].reason == "cancelled"
        stats = await settled(engine)
        assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)
        # The chunks' node holds their KV (a snapshot is checked by the answer below).
        assert check_tree_kv(engine, reference.model).memory == (
            1 if engine_segments(engine) else 0)
        retry = await complete(engine, prompt, 16)
        assert retry.finish.cached_tokens == watcher.fed == 96
        assert retry.tokens == reference.greedy(prompt, 16)
    finally:
        engine.shutdown()


def engine_segments(engine) -> bool:
    return engine._scheduler.kv.segments


async def test_a_ready_engine_has_frozen_what_it_loaded(engine):
    """A full collection walks only what came after loading (it walked the libraries, the
    tokenizer and the model: 150-190 ms on 2 cores, a pause every running stream felt)."""
    assert gc.get_freeze_count() > 100_000
