"""Sharing, memory budget, cancellation and failure isolation, on the plain-KV model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.admission import tokens_reserved
from engine.api import Finish, PromptLogprobs, QueueFull, RequestFailed, SamplingParams, TokenEvent
from engine.generator import Generator
from engine.streams import EventQueue
from tests.engine.support import (
    Reference,
    as_on_a_gpu,
    cancel_after,
    complete,
    settled,
    start_engine,
)
from tests.faults import PrefillWatcher, faulty_loader, loader_wrapping

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def llama_dir(family_model_dir) -> str:
    return family_model_dir("llama")


@pytest.fixture(scope="module")
def reference(llama_dir) -> Reference:
    return Reference(llama_dir)


@pytest.fixture(scope="module")
def engine(llama_dir):
    engine = start_engine(llama_dir, cache_bytes=1 << 30)
    yield engine
    engine.shutdown()


def random_prompt(seed: int, length: int, vocab: int = 2000) -> list[int]:
    # Ids above the special tokens, spread so prompts with different seeds share nothing.
    return [10 + (seed * 7919 + i * 104729) % (vocab - 10) for i in range(length)]


async def test_thundering_herd_computes_a_new_prefix_once(engine, reference):
    prefix = random_prompt(1, 1024)
    prompts = [prefix + random_prompt(100 + i, 8) for i in range(8)]
    before = engine.stats().counters.prefill_tokens
    results = await asyncio.gather(*(complete(engine, p, 8) for p in prompts))
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference.greedy(prompt, 8)
    # One request prefills the prefix with its suffix; the other seven wait for it and
    # prefill only their own 8 tokens.
    assert engine.stats().counters.prefill_tokens - before == 1024 + 8 * 8
    assert sorted(r.finish.cached_tokens for r in results)[1:] == [1024] * 7


async def test_prompts_diverging_after_a_short_header_are_each_computed_once(engine, reference):
    # Two system prompts behind one chat-template header: while the first group's prompt
    # is pending, the second group's computes without a reservation, and its followers
    # wait for it instead of computing it again.
    header = random_prompt(20, 5)
    systems = [random_prompt(21 + g, 200) for g in range(2)]
    prompts = [header + systems[g] + random_prompt(30 + i, 10) for i, g in
               enumerate([0, 1, 1, 0, 1])]
    before = engine.stats().counters.prefill_tokens
    results = await asyncio.gather(*(complete(engine, p, 6) for p in prompts))
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference.greedy(prompt, 6)
    # Each group's header + system prompt once, then only each question.
    assert engine.stats().counters.prefill_tokens - before == 2 * 205 + 5 * 10


async def tokens_in_order(streams: list) -> tuple[list[int], list[list[int]]]:
    """Read `streams` at once: the index of the stream each token came from, in the order
    the engine gave them, and each stream's tokens. Taken as each event reaches this loop
    (`forward_to`, as a job reads its choices): a task reading a stream takes all its
    queued tokens at once, so on a busy machine tasks reading several streams saw a second
    token of one before a first token of another that the engine gave before it."""
    order: list[int] = []
    outputs: list[list[int]] = [[] for _ in streams]
    arrived = EventQueue()
    for index, stream in enumerate(streams):
        stream.forward_to(lambda event, index=index: arrived.put((index, event)))
    open_streams = len(streams)
    while open_streams:
        index, event = await arrived.get()
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, TokenEvent):
            order.append(index)
            outputs[index].append(event.token)
        elif isinstance(event, Finish):
            open_streams -= 1
    return order, outputs


async def test_prompts_arriving_together_are_all_prefilled_before_any_decodes(
        llama_dir, reference):
    # Three prompts of several chunks each reach an idle engine at once (a burst; handed
    # over together, so a loaded machine cannot spread them over steps). None starts
    # decoding while another's prompt is still being computed, so no stream stalls for
    # the others' prompts once it has started: every first token comes before any
    # second one.
    engine = start_engine(llama_dir, prefill_chunk_tokens=32)
    try:
        prompts = [random_prompt(60 + i, 100) for i in range(3)]
        order, outputs = await tokens_in_order(
            engine.submit_all(prompts, _greedy(max_tokens=3, ignore_eos=True)))
        firsts = [order.index(i) for i in range(3)]
        seconds = [order.index(i, first + 1) for i, first in enumerate(firsts)]
        assert max(firsts) < min(seconds)
        for prompt, tokens in zip(prompts, outputs):
            expected = reference.greedy(prompt, 3)  # up to its EOS, which ignore_eos runs past
            assert tokens[:len(expected)] == expected
    finally:
        engine.shutdown()


@pytest.mark.parametrize("decoding", [True, False])
async def test_a_short_prompt_does_not_wait_for_a_long_prompts_prefill(
        llama_dir, reference, monkeypatch, decoding: bool):
    # A long document (19 chunks of 32 tokens) and a short chat arrive in that order,
    # while another stream decodes or at an idle engine (a burst, which would hold the
    # chat until the document is computed, were that quick: here the document counts
    # as slow): the chat's prompt, which one chunk finishes, goes first, and its whole
    # answer comes before the document's first token.
    monkeypatch.setattr("engine.scheduler.BURST_HOLD_SECONDS", 0.0)
    engine = start_engine(llama_dir, prefill_chunk_tokens=32)
    try:
        if decoding:
            busy = engine.submit(random_prompt(70, 16),
                                 _greedy(max_tokens=4000, ignore_eos=True))
            await anext(aiter(busy))
        prompts = [random_prompt(71, 600), random_prompt(72, 12)]
        order, outputs = await tokens_in_order(
            engine.submit_all(prompts, _greedy(max_tokens=3, ignore_eos=True)))
        if decoding:
            busy.cancel()
        assert order == [1, 1, 1, 0, 0, 0]
        for prompt, tokens in zip(prompts, outputs):
            expected = reference.greedy(prompt, 3)  # up to its EOS, which ignore_eos runs past
            assert tokens[:len(expected)] == expected
    finally:
        engine.shutdown()


async def test_a_burst_a_device_computes_in_a_moment_stays_whole(
        llama_dir, reference, monkeypatch):
    # The same document and chat at an idle engine, the document now quick to compute
    # (under the hold): the burst keeps the chat until the document is computed, and
    # both first tokens come from the same step.
    monkeypatch.setattr("engine.scheduler.BURST_HOLD_SECONDS", 1e9)
    engine = start_engine(llama_dir, prefill_chunk_tokens=32)
    try:
        prompts = [random_prompt(71, 600), random_prompt(72, 12)]
        order, outputs = await tokens_in_order(
            engine.submit_all(prompts, _greedy(max_tokens=3, ignore_eos=True)))
        assert sorted(order[:2]) == [0, 1]
        for prompt, tokens in zip(prompts, outputs):
            expected = reference.greedy(prompt, 3)  # up to its EOS, which ignore_eos runs past
            assert tokens[:len(expected)] == expected
    finally:
        engine.shutdown()


async def test_a_stream_ends_before_its_kv_is_copied_to_the_tree(
        llama_dir, reference, monkeypatch):
    # Copying an ended row's KV out of the batch waits for the step queued behind the
    # one that ended it: the stream's end (an agent waits for it to send its next turn)
    # does not. Here the copy cannot start until the client has seen that end. The next
    # turn, sent at once, still finds the whole reply in the tree: the engine takes it
    # in after the copy.
    ended = threading.Event()
    remove = Generator.remove

    def remove_once_the_client_saw_the_end(self, uids, read=None):
        assert ended.wait(60)
        return remove(self, uids, read)

    monkeypatch.setattr(Generator, "remove", remove_once_the_client_saw_the_end)
    engine = start_engine(llama_dir, cache_bytes=1 << 30)
    try:
        prompt = random_prompt(80, 40)
        async with asyncio.timeout(30):
            reply = await complete(engine, prompt, 6, ignore_eos=True)
        ended.set()
        turn = prompt + reply.tokens + random_prompt(81, 5)
        result = await complete(engine, turn, 4)
        assert result.finish.cached_tokens >= len(prompt) + len(reply.tokens) - 1
        assert result.tokens == reference.greedy(turn, 4)
    finally:
        ended.set()
        engine.shutdown()


async def test_cancel_mid_decode_releases_everything(engine):
    event = await cancel_after(engine.submit(random_prompt(2, 64), _greedy(max_tokens=4000)), 3)
    assert event.reason == "cancelled"
    assert 3 <= event.completion_tokens < 4000
    stats = await settled(engine)
    assert (stats.running, stats.waiting, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0, 0)


async def test_many_streams_each_get_their_own_tokens_in_order(engine, reference):
    # Events reach the loop in batches (one wake-up per step, engine/streams.py LoopRelay), and
    # rows that end at the same step leave the batch together: every stream still gets
    # exactly its own tokens, in order, then its Finish, and nothing stays pinned.
    prompts = [random_prompt(60 + i, 24) for i in range(12)]
    results = await asyncio.gather(*(complete(engine, p, 8, ignore_eos=True) for p in prompts))
    for prompt, result in zip(prompts, results):
        expected = reference.greedy(prompt, 8)  # up to its EOS, which ignore_eos runs past
        assert result.tokens[:len(expected)] == expected
        assert result.finish.completion_tokens == len(result.tokens) == 8
    stats = await settled(engine)
    assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)


async def test_a_request_whose_callers_loop_closed_is_cancelled(engine):
    before = engine.stats().counters.generated_tokens

    def submit_and_leave() -> None:
        async def submit() -> None:
            engine.submit(random_prompt(3, 32), _greedy(max_tokens=4000))

        asyncio.run(submit())  # the loop closes before any token is delivered

    await asyncio.to_thread(submit_and_leave)
    stats = await settled(engine)
    assert (stats.running, stats.waiting, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0, 0)
    assert stats.counters.generated_tokens - before < 4000


async def test_cancel_while_waiting_for_a_shared_prefix(engine, reference):
    prefix = random_prompt(3, 600)
    first = asyncio.create_task(complete(engine, prefix + [11], 4))
    await asyncio.sleep(0)
    waiter = engine.submit(prefix + [12], _greedy(max_tokens=4))
    waiter.cancel()
    events = [event async for event in waiter]
    assert events[-1].reason == "cancelled"
    assert (await first).tokens == reference.greedy(prefix + [11], 4)
    stats = await settled(engine)
    assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)


async def test_a_waiter_reuses_the_chunks_of_a_prefill_cancelled_before_it(
        llama_dir, reference, monkeypatch):
    """The request computing a prefix is cancelled three chunks in, while another waits
    for that prefix: the waiter starts from those chunks, not from nothing."""
    watcher = PrefillWatcher()
    monkeypatch.setattr("engine.engine.load_model", loader_wrapping(watcher.around))
    engine = start_engine(llama_dir, cache_bytes=1 << 30, prefill_chunk_tokens=32)
    try:
        prefix = random_prompt(5, 300)
        watcher.watch(96, lambda: engine.cancel("leader"))
        leader = engine.submit(prefix + [11], _greedy(max_tokens=4), request_id="leader")
        waiter = asyncio.create_task(complete(engine, prefix + [12], 4))
        assert [event async for event in leader][-1].reason == "cancelled"
        result = await waiter
        assert result.finish.cached_tokens == 96
        assert result.tokens == reference.greedy(prefix + [12], 4)
        stats = await settled(engine)
        assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)
    finally:
        engine.shutdown()


async def test_tiny_budget_stays_bounded_and_correct(llama_dir, reference):
    # ~512 bytes per token on the tiny model: room for about 80 cached tokens.
    budget = 40_000
    engine = start_engine(llama_dir, cache_bytes=budget, max_batch_size=4)
    try:
        scheduler = engine._scheduler
        step, after_steps = scheduler._step, []

        def observed_step():
            # Runs on the worker thread, so it sees the tree between steps, never mid-update.
            step()
            after_steps.append(scheduler.tree.stats())

        scheduler._step = observed_step
        prompts = [random_prompt(200 + i, 40 + i) for i in range(12)]
        tasks = [asyncio.create_task(complete(engine, p, 6)) for p in prompts]
        await asyncio.gather(*tasks)
        # Pinned paths of running requests may exceed the budget; nothing else may.
        assert all(s.total_bytes <= max(budget, s.pinned_bytes) for s in after_steps)
        assert any(s.pinned_bytes for s in after_steps)
        for prompt, task in zip(prompts, tasks):
            assert task.result().tokens == reference.greedy(prompt, 6)
        stats = await settled(engine)
        assert stats.tree.pinned_bytes == 0
        assert stats.tree.total_bytes <= budget
        assert stats.tree.evictions > 0
        assert engine._scheduler.tree.clear() >= 0
        assert engine.stats().tree.total_bytes == 0
    finally:
        engine.shutdown()


async def test_tokens_in_flight_limit_bounds_the_batch(llama_dir, reference):
    engine = start_engine(llama_dir, cache_bytes=1 << 30, max_tokens_in_flight=130)
    try:
        scheduler = engine._scheduler
        step, reserved = scheduler._step, []

        def observed_step():
            reserved.append(sum(tokens_reserved(r, scheduler.limits)
                                for r in scheduler.running.values()))
            step()

        scheduler._step = observed_step
        prompts = [random_prompt(500 + i, 40) for i in range(4)]
        results = await asyncio.gather(*(complete(engine, p, 20) for p in prompts))
        assert [r.tokens for r in results] == [reference.greedy(p, 20) for p in prompts]
        # Two requests of 60 tokens fit in 130, a third never joins them.
        assert max(reserved) == 120
    finally:
        engine.shutdown()


@pytest.mark.parametrize("gpu_steps", [False, True], ids=["CPU steps", "GPU steps"])
async def test_a_request_that_outgrows_its_reserve_is_preempted_and_answers_the_same(
        llama_dir, reference, monkeypatch, gpu_steps):
    """Admission counts a request at most `output_reserve` tokens ahead: two that may add
    60 run together in a room of 130, and when their KV outgrows it the newer leaves the
    batch, its KV cached, and comes back to finish where it was, as greedy as alone; with
    a GPU's pipelined steps too, where the row leaves with a token still being computed."""
    if gpu_steps:
        monkeypatch.setattr(Generator, "__init__", as_on_a_gpu(Generator.__init__))
    engine = start_engine(llama_dir, cache_bytes=1 << 30, max_tokens_in_flight=130)
    try:
        engine._scheduler.limits.output_reserve = 10
        prompts = [random_prompt(520 + i, 40) for i in range(2)]
        results = await asyncio.gather(*(complete(engine, p, 60, ignore_eos=True)
                                         for p in prompts))
        for prompt, result in zip(prompts, results):
            assert result.tokens == reference.greedy_ignoring_eos(prompt, 60)
            assert result.finish.reason == "length"
        stats = await settled(engine)
        assert stats.counters.requests_preempted == 1
        # Come back, it read its KV from the tree: only its last token was fed again.
        assert stats.counters.prefill_tokens == 2 * 40 + 1
        assert stats.tree.pinned_bytes == 0
    finally:
        engine.shutdown()


async def test_a_chat_takes_a_row_from_a_request_holding_every_row(llama_dir, reference):
    """Three choices of one request hold both rows of the batch and the third waits; a
    chat sent while they decode does not wait for one of them to end: the newest gives
    its row up, the chat answers before any choice ends, and the choice comes back for
    its KV in the tree and answers as greedy as alone."""
    engine = start_engine(llama_dir, cache_bytes=1 << 30, max_batch_size=2)
    try:
        prompt = random_prompt(700, 24)
        choices = engine.submit_all([prompt] * 3, _greedy(max_tokens=150, ignore_eos=True),
                                    owner="many")
        ended: list[str] = []

        async def drain(stream, name: str) -> list[int]:
            tokens = [event.token async for event in stream if isinstance(event, TokenEvent)]
            ended.append(name)
            return tokens

        tasks = [asyncio.create_task(drain(stream, "choice")) for stream in choices]
        while engine.stats().counters.generated_tokens < 8:
            await asyncio.sleep(0.005)
        chat = random_prompt(701, 16)
        answer = await complete(engine, chat, 4)
        ended.append("chat")
        assert answer.tokens == reference.greedy(chat, 4)
        expected = reference.greedy_ignoring_eos(prompt, 150)
        assert await asyncio.gather(*tasks) == [expected] * 3
        assert ended[0] == "chat"
        stats = await settled(engine)
        assert stats.counters.requests_preempted == 1
        assert stats.tree.pinned_bytes == 0
    finally:
        engine.shutdown()


async def test_queue_limit_counts_only_requests_not_yet_admitted(llama_dir):
    engine = start_engine(llama_dir, cache_bytes=1 << 30, max_batch_size=1, max_queue=2)
    try:
        running = engine.submit(random_prompt(600, 16), _greedy(max_tokens=4000, ignore_eos=True))
        assert isinstance(await anext(running), TokenEvent)  # admitted: no longer queued
        queued = [asyncio.create_task(complete(engine, random_prompt(601 + i, 16), 4))
                  for i in range(2)]
        await asyncio.sleep(0)
        assert engine.stats().waiting == 2
        with pytest.raises(QueueFull):
            engine.submit(random_prompt(603, 16), _greedy(max_tokens=4))
        running.cancel()
        assert all(r.finish.reason == "length" for r in await asyncio.gather(*queued))
        assert (await settled(engine)).waiting == 0
    finally:
        engine.shutdown()


async def test_a_cancelled_requests_queue_place_is_free_at_once(llama_dir):
    """A request refused for a full queue cancels its choices queued so far: their places
    are free when cancel returns, not when the engine's thread next takes its messages,
    so requests that come meanwhile and fit are not refused for them."""
    engine = start_engine(llama_dir, cache_bytes=1 << 30, max_batch_size=1, max_queue=3)
    try:
        running = engine.submit(random_prompt(610, 16), _greedy(max_tokens=4000, ignore_eos=True))
        assert isinstance(await anext(running), TokenEvent)
        refused = [engine.submit(random_prompt(611 + i, 16), _greedy(max_tokens=4))
                   for i in range(3)]
        with pytest.raises(QueueFull):
            engine.submit(random_prompt(614, 16), _greedy(max_tokens=4))
        for stream in refused:
            stream.cancel()
        assert engine.stats().waiting == 0
        fits = [engine.submit(random_prompt(615 + i, 16), _greedy(max_tokens=4))
                for i in range(3)]
        running.cancel()
        for stream in fits:
            assert [event async for event in stream][-1].reason == "length"
        assert (await settled(engine)).waiting == 0
    finally:
        engine.shutdown()


async def test_sampling_with_a_seed_is_reproducible(engine):
    prompt = random_prompt(4, 32)
    options = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "min_p": 0.01, "seed": 1234}
    first = await complete(engine, prompt, 24, **options)
    second = await complete(engine, prompt, 24, **options)
    other = await complete(engine, prompt, 24, **{**options, "seed": 99})
    assert first.tokens == second.tokens
    assert first.tokens != other.tokens


async def test_seeded_requests_sample_alike_alone_and_in_a_mixed_batch(engine):
    """A batch's sampled rows are drawn together, grouped by their filters: a seeded
    request's tokens are the ones it samples alone, whatever temperatures, filters, seeds
    and greedy rows decode beside it."""
    seeded = [{"temperature": 0.8, "top_k": 3, "seed": 4321},
              {"temperature": 1.2, "top_p": 0.5, "seed": 8765},
              {"temperature": 0.7, "min_p": 0.2, "seed": 1}]
    prompts = [random_prompt(7 + i, 24) for i in range(len(seeded))]
    alone = [(await complete(engine, prompt, 20, ignore_eos=True, **options)).tokens
             for prompt, options in zip(prompts, seeded)]
    neighbours = [{"temperature": 1.3, "seed": 5}, {"temperature": 0.5, "top_k": 40},
                  {"temperature": 0.0}, {"temperature": 0.8, "top_k": 3, "seed": 6}]
    together = await asyncio.gather(
        *(complete(engine, random_prompt(20 + i, 24), 20, ignore_eos=True, **options)
          for i, options in enumerate(neighbours)),
        *(complete(engine, prompt, 20, ignore_eos=True, **options)
          for prompt, options in zip(prompts, seeded)))
    assert [c.tokens for c in together[len(neighbours):]] == alone


async def test_logit_bias_forces_a_token(engine):
    result = await complete(engine, random_prompt(5, 16), 5, logit_bias={777: 100.0},
                            ignore_eos=True)
    assert result.tokens == [777] * 5


async def test_penalties_push_back_a_repeated_token(engine):
    # A bias makes greedy decoding repeat one token; penalties on repeats break the run.
    prompt, bias = random_prompt(6, 16), {777: 12.0}
    plain = await complete(engine, prompt, 24, logit_bias=bias, ignore_eos=True)
    assert plain.tokens == [777] * 24
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                    {"repetition_penalty": 4.0}):
        penalised = await complete(engine, prompt, 24, logit_bias=bias, ignore_eos=True,
                                   **penalty)
        assert penalised.tokens.count(777) < 24, penalty


async def test_penalized_requests_decode_alike_alone_and_in_a_batch(engine):
    """A batch's penalties and biases are applied together, each row from its own
    context: a request's tokens are the ones it generates alone, beside rows with other
    penalties and rows with none."""
    bias = {777: 3.0, 901: 2.5}
    asks = [{"logit_bias": bias}, {"logit_bias": bias, "frequency_penalty": 1.5},
            {"logit_bias": bias, "presence_penalty": 1.0, "repetition_penalty": 1.3},
            {"repetition_penalty": 2.0}, {"logit_bias": {5: -100.0}, "frequency_penalty": 0.5}]
    prompts = [random_prompt(40 + i, 20) for i in range(len(asks))]
    alone = [(await complete(engine, prompt, 24, ignore_eos=True, **ask)).tokens
             for prompt, ask in zip(prompts, asks)]
    together = await asyncio.gather(
        *(complete(engine, random_prompt(60 + i, 20), 24, ignore_eos=True) for i in range(3)),
        *(complete(engine, prompt, 24, ignore_eos=True, **ask)
          for prompt, ask in zip(prompts, asks)))
    assert [c.tokens for c in together[3:]] == alone


async def test_presence_and_frequency_penalties_count_generated_tokens_only(engine):
    """OpenAI's definition: the prompt does not count, so a token the prompt repeats is
    not pushed back before the model generates it."""
    prompt, bias = random_prompt(6, 16) + [777] * 16, {777: 12.0}
    first = await complete(engine, prompt, 1, logit_bias=bias, presence_penalty=2.0,
                           frequency_penalty=2.0)
    assert first.tokens == [777]


async def test_the_frequency_penalty_counts_every_generated_token(engine):
    """No window: after 40 repeats the penalty is 2 x 40 and still growing, so the
    strongest bias gives way before 64 tokens (counting the last 20 only, it never did)."""
    result = await complete(engine, random_prompt(6, 16), 64, logit_bias={777: 100.0},
                            frequency_penalty=2.0, ignore_eos=True)
    assert result.tokens[:40] == [777] * 40 and result.tokens.count(777) < 64


async def test_logprobs_report_the_chosen_token_and_sorted_alternatives(engine):
    result = await complete(engine, random_prompt(7, 16), 6, logprobs=3)
    for event in result.events:
        assert event.logprob.token == event.token
        values = [alt.logprob for alt in event.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert event.logprob.logprob == pytest.approx(values[0])


async def test_a_prompt_sent_again_scores_its_answer_exactly_as_its_cold_run(engine):
    # Its tree match stops short of its last token, which both runs feed alone after
    # the rest: the same forward on the same KV, so every logprob is equal to the bit.
    prompt = random_prompt(17, 300)
    cold = await complete(engine, prompt, 4, logprobs=5)
    again = await complete(engine, prompt, 4, logprobs=5)
    assert (cold.finish.cached_tokens, again.finish.cached_tokens) == (0, len(prompt) - 1)
    assert again.tokens == cold.tokens
    for mine, theirs in zip(again.events, cold.events):
        assert mine.logprob == theirs.logprob and mine.top_logprobs == theirs.top_logprobs


async def test_stop_string_is_never_emitted(engine):
    prompt = random_prompt(8, 16)
    free = await complete(engine, prompt, 24, ignore_eos=True)
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 3]
    stopped = await complete(engine, prompt, 24, stop=(stop,), ignore_eos=True)
    assert stopped.finish.reason == "stop"
    assert stopped.finish.matched_stop == stop
    assert stopped.text == free.text[: free.text.index(stop)]


async def test_stop_token_id_ends_the_stream(engine):
    prompt = random_prompt(9, 16)
    free = await complete(engine, prompt, 16, ignore_eos=True)
    stop_token = free.tokens[5]
    stopped = await complete(engine, prompt, 16, stop_token_ids=(stop_token,), ignore_eos=True)
    assert stopped.finish.reason == "stop"
    assert stopped.finish.matched_stop == stop_token
    assert stopped.tokens == free.tokens[: free.tokens.index(stop_token)]


async def test_min_tokens_keeps_stop_tokens_and_strings_from_ending_the_first_tokens(engine):
    """vLLM's `min_tokens`: the first tokens are never a stop token (barred from their
    draws) nor end on a stop string, which is looked for in the text after them."""
    prompt = random_prompt(11, 16)
    free = await complete(engine, prompt, 16, ignore_eos=True)
    first = free.tokens[0]
    barred = await complete(engine, prompt, 16, stop_token_ids=(first,), min_tokens=3,
                            ignore_eos=True)
    assert barred.tokens[0] != first and first not in barred.tokens[:3]
    assert len(barred.tokens) >= 3
    opening = engine.tokenizer.decode(free.tokens[:2], skip_special_tokens=True)
    assert opening
    stopped = await complete(engine, prompt, 16, stop=(opening,), ignore_eos=True)
    assert (stopped.finish.reason, stopped.text) == ("stop", "")
    shown = await complete(engine, prompt, 16, stop=(opening,), min_tokens=2, ignore_eos=True)
    assert shown.tokens[:2] == free.tokens[:2] and shown.text.startswith(opening)
    assert shown.text == free.text[:len(shown.text)]


async def test_a_stop_token_releases_text_held_for_a_stop_string(engine):
    """Text held back in case it starts a stop string is still shown when a stop token,
    not a stop string, ends the stream."""
    prompt = random_prompt(10, 16)
    free = await complete(engine, prompt, 12, ignore_eos=True)
    end = next(i for i in range(4, 12) if free.tokens[i] not in free.tokens[:i])
    never = "\x00" * 8  # holds back the last 7 characters until the stream ends
    stopped = await complete(engine, prompt, 12, stop=(never,),
                             stop_token_ids=(free.tokens[end],), ignore_eos=True)
    assert stopped.finish.matched_stop == free.tokens[end]
    assert stopped.text == engine.tokenizer.decode(free.tokens[:end], skip_special_tokens=True)


async def test_max_tokens_ends_with_length(engine):
    result = await complete(engine, random_prompt(10, 8), 7, ignore_eos=True)
    assert (result.finish.reason, result.finish.completion_tokens, len(result.tokens)) == (
        "length", 7, 7)


async def test_prompt_beyond_the_context_is_refused(engine):
    from engine.api import ContextLengthExceeded

    with pytest.raises(ContextLengthExceeded):
        engine.submit([11] * 100, _greedy(max_tokens=engine.context_length))


def start_faulty_engine(llama_dir, monkeypatch, used: list[list[int]]):
    """An engine whose model fails every forward pass that feeds a token no list in `used`
    holds (the good requests' prompts and outputs), and that token."""
    seen = {t for tokens in used for t in tokens}
    fault = next(t for t in range(1000, 2000) if t not in seen)
    monkeypatch.setattr("engine.engine.load_model", faulty_loader(fault))
    return start_engine(llama_dir, cache_bytes=1 << 30), fault


async def test_a_failing_forward_fails_only_its_request(llama_dir, reference, monkeypatch):
    good = [random_prompt(300 + i, 30 + 5 * i) for i in range(4)]
    expected = [reference.greedy(prompt, 12) for prompt in good]
    engine, fault = start_faulty_engine(llama_dir, monkeypatch, good + expected)
    try:
        bad = random_prompt(400, 30) + [fault] + random_prompt(401, 4)
        good_tasks = [asyncio.create_task(complete(engine, p, 12)) for p in good]
        with pytest.raises(RequestFailed):
            await complete(engine, bad, 12)
        assert [(await task).tokens for task in good_tasks] == expected
        stats = await settled(engine)
        assert stats.counters.requests_failed == 1
        assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)
        # The engine keeps serving.
        assert (await complete(engine, good[0], 12)).tokens == expected[0]
    finally:
        engine.shutdown()


async def test_one_token_prompts_behind_a_cached_preamble_each_get_their_own_answer(
        engine, reference):
    # Classification: many short prompts behind one instruction, one token each. They
    # are computed together (more of them than prefill_batch_size) and end on their first
    # token, which each still gets right, with the preamble counted as cached.
    preamble = random_prompt(500, 40)
    await complete(engine, preamble + random_prompt(501, 6), 1)
    prompts = [preamble + random_prompt(510 + i, 6) for i in range(20)]
    steps = engine.stats().counters.steps
    results = await asyncio.gather(*(complete(engine, p, 1) for p in prompts))
    for prompt, result in zip(prompts, results):
        assert result.tokens == reference.greedy(prompt, 1)
        assert result.finish.reason in ("length", "stop")
        assert (result.finish.prompt_tokens, result.finish.cached_tokens) == (46, 40)
    stats = await settled(engine)
    # One by one, each would take a step of its own at least.
    assert stats.counters.steps - steps < len(prompts)
    assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)


async def test_a_faulty_prompt_computed_with_others_fails_alone(llama_dir, reference,
                                                                monkeypatch):
    preamble = random_prompt(600, 40)
    good = [preamble + random_prompt(610 + i, 6) for i in range(6)]
    expected = [reference.greedy(prompt, 1) for prompt in good]
    engine, fault = start_faulty_engine(llama_dir, monkeypatch, good + expected)
    try:
        await complete(engine, preamble + random_prompt(601, 6), 1)
        bad = preamble + random_prompt(620, 3) + [fault] + random_prompt(621, 2)
        tasks = [asyncio.create_task(complete(engine, p, 1)) for p in [*good[:3], bad, *good[3:]]]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[3], RequestFailed)
        assert [r.tokens for r in results[:3] + results[4:]] == expected
        stats = await settled(engine)
        assert stats.counters.requests_failed == 1
        assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)
    finally:
        engine.shutdown()


def _greedy(**options):
    from engine.api import SamplingParams

    return SamplingParams(temperature=0.0, **options)


async def test_a_prompts_logprobs_are_computed_a_chunk_a_step_and_stop_when_cancelled(
        llama_dir):
    """Scoring a long prompt (`echo` with logprobs) neither holds the streams beside it
    until it is done nor outlives its request's cancel: another request starts and ends
    while it is scored, and a cancelled one ends at once, its scoring dropped."""
    engine = start_engine(llama_dir, prefill_chunk_tokens=16)
    try:
        prompt = [(7 * i + 3) % 200 + 10 for i in range(1500)]
        scored = engine.submit(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))

        async def scores() -> tuple[float, PromptLogprobs]:
            async for event in scored:
                if isinstance(event, PromptLogprobs):
                    return time.perf_counter(), event
            raise AssertionError("no prompt logprobs")

        scoring = asyncio.create_task(scores())
        short = await complete(engine, [5, 6, 7], max_tokens=4)
        short_done = time.perf_counter()
        scored_at, logprobs = await scoring
        assert len(short.tokens) == 4 and short_done < scored_at
        assert len(logprobs.tokens) == len(prompt)

        one = [event async for event in engine.submit(
            prompt[:1], SamplingParams(max_tokens=1, prompt_logprobs=0))]
        assert isinstance(one[0], PromptLogprobs) and isinstance(one[-1], Finish)
        assert [event.logprob for event in one[0].tokens] == [None]  # nothing before it

        cancelled = engine.submit(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
        engine.cancel(cancelled.request_id)
        seen = [event async for event in cancelled]
        assert [type(event) for event in seen] == [Finish]
        assert seen[0].reason == "cancelled"
        assert (await settled(engine)).waiting == 0
    finally:
        engine.shutdown()
