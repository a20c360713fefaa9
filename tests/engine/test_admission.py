"""Who starts next: the prefill window holds long prompts back, never short ones; a full
batch admits nobody, without matching the queue against the tree."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.admission import SHORT_PROMPT_TOKENS, SchedulerLimits, admit
from engine.api import Readout, SamplingParams
from engine.generation import Generation
from engine.tokenizer import ModelTokenizer
from radix import RadixTree


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir) -> ModelTokenizer:
    return ModelTokenizer(load_tokenizer(demo_model_dir))


def test_short_prompts_are_admitted_past_a_full_prefill_window(tokenizer) -> None:
    tree = RadixTree(1 << 20, free=lambda handle: None)

    def generation(name: str, length: int) -> Generation:
        return Generation(name, list(range(10, 10 + length)), SamplingParams(max_tokens=1),
                          lambda event: None, tokenizer, tokenizer.vocab_size, tree)

    long = [generation(f"long{i}", 200) for i in range(3)]
    short = [generation(f"short{i}", SHORT_PROMPT_TOKENS) for i in range(12)]
    mostly_cached = generation("cached", 300)
    waiting = [*long, *short, mostly_cached]
    running: list[Generation] = []
    limits = SchedulerLimits(max_batch_size=14, prefill_batch_size=2,
                             prefill_chunk_tokens=None, prefill_stall_ratio=None,
                             prefill_stall_floor=0.0, max_tokens_in_flight=1 << 20,
                             cache_bytes=1 << 20)

    def cached_length(g: Generation) -> int:
        return 290 if g is mostly_cached else 0

    admit(waiting, running, limits, cached_length, lambda g: running.append(g) is None)
    # Cache-aware order first; two long prompts fill the window, the third waits; short
    # ones (the mostly cached one too) take the rows left, up to the batch size.
    assert running == [mostly_cached, *long[:2], *short[:11]]
    assert waiting == [long[2], short[11]]


def test_a_full_batch_admits_nobody_and_matches_no_waiting_prompt(tokenizer) -> None:
    tree = RadixTree(1 << 20, free=lambda handle: None)
    queue = [Generation(f"g{i}", list(range(10, 60)), SamplingParams(max_tokens=1),
                        lambda event: None, tokenizer, tokenizer.vocab_size, tree)
             for i in range(6)]
    running, waiting = queue[:2], queue[2:]
    limits = SchedulerLimits(max_batch_size=2, prefill_batch_size=2,
                             prefill_chunk_tokens=None, prefill_stall_ratio=None,
                             prefill_stall_floor=0.0, max_tokens_in_flight=1 << 20,
                             cache_bytes=1 << 20)
    matched: list[Generation] = []

    def cached_length(g: Generation) -> int:
        matched.append(g)
        return 0

    admit(waiting, running, limits, cached_length, lambda g: running.append(g) is None)
    assert running == queue[:2] and waiting == queue[2:]
    assert matched == []
    assert all(g.passed_over == 0 for g in waiting)  # a round nobody could win
    running.pop()
    admit(waiting, running, limits, cached_length, lambda g: running.append(g) is None)
    assert running == [queue[0], queue[2]] and matched == queue[2:]


def test_a_chats_next_turn_waits_behind_every_client_request(tokenizer) -> None:
    """Chats that ended together leave their next turns to prefill (cache-only readouts):
    their prefixes, the whole chat and its reply, are the longest cached, yet a client's
    request with nothing cached goes first, and one passed over for long still does."""
    tree = RadixTree(1 << 20, free=lambda handle: None)
    guess = SamplingParams(max_tokens=0, temperature=0.0, readout=Readout(cache_only=True))

    def generation(name: str, params: SamplingParams) -> Generation:
        return Generation(name, list(range(10, 300)), params, lambda event: None, tokenizer,
                          tokenizer.vocab_size, tree)

    guesses = [generation(f"next-turn{i}", guess) for i in range(3)]
    client = generation("client", SamplingParams(max_tokens=8))
    guesses[0].passed_over = 100
    waiting = [*guesses, client]
    running: list[Generation] = []
    limits = SchedulerLimits(max_batch_size=2, prefill_batch_size=8,
                             prefill_chunk_tokens=None, prefill_stall_ratio=None,
                             prefill_stall_floor=0.0, max_tokens_in_flight=1 << 20,
                             cache_bytes=1 << 20)
    cached = {client: 0, guesses[0]: 280, guesses[1]: 289, guesses[2]: 270}
    admit(waiting, running, limits, cached.__getitem__,
          lambda g: running.append(g) is None)
    assert running == [client, guesses[1]]
    assert waiting == [guesses[0], guesses[2]]
