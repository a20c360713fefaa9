"""Who starts next: the prefill window holds long prompts back, never short ones; a full
batch admits nobody, without matching the queue against the tree; a request holding no
row takes one from a request holding several."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.admission import SHORT_PROMPT_TOKENS, SchedulerLimits, admit, rows_to_free
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


def _limits(rows: int, tokens: int = 1 << 20) -> SchedulerLimits:
    return SchedulerLimits(max_batch_size=rows, prefill_batch_size=8, prefill_chunk_tokens=None,
                           prefill_stall_ratio=None, prefill_stall_floor=0.0,
                           max_tokens_in_flight=tokens, cache_bytes=1 << 20)


def _choices(tokenizer, tree: RadixTree, owner: str, n: int, max_tokens: int
             ) -> list[Generation]:
    """A request's n choices: one prompt, which the first computes for all."""
    return [Generation(f"{owner}-{j}", list(range(10, 30)), SamplingParams(max_tokens=max_tokens),
                       lambda event: None, tokenizer, tokenizer.vocab_size, tree, owner=owner)
            for j in range(n)]


def _rounds_waited(chat: Generation, waiting: list[Generation], limits: SchedulerLimits,
                   arrives: int) -> int:
    """Admission rounds, each after the oldest running generation ends, from the one
    `chat` arrives at (once the others have run that many) to the one that starts it."""
    running: list[Generation] = []

    def cached_length(g: Generation) -> int:
        return 0 if g is chat else len(g.tokens) - 1  # the choices' prompt is cached

    for rounds in range(len(waiting) + arrives + 1):
        if rounds == arrives:
            waiting.append(chat)
        admit(waiting, running, limits, cached_length, lambda g: running.append(g) is None)
        if chat in running:
            return rounds - arrives
        running.pop(0)
    raise AssertionError("the chat never started")


@pytest.mark.parametrize("limits", [_limits(rows=4), _limits(rows=64, tokens=4 * 1020 + 40)],
                         ids=["rows", "tokens"])
def test_a_requests_many_choices_leave_a_short_chat_the_next_free_place(tokenizer, limits
                                                                       ) -> None:
    """n=32 choices that fill the batch's rows (or its tokens in flight), each passed over
    in every round that started one of the others: counted per choice, they all starved,
    went first, and the 8-token chat that came meanwhile waited for nearly every one."""
    tree = RadixTree(1 << 20, free=lambda handle: None)
    chat = Generation("chat", list(range(10, 20)), SamplingParams(max_tokens=8),
                      lambda event: None, tokenizer, tokenizer.vocab_size, tree)
    waiting = _choices(tokenizer, tree, "many", 32, 1000)
    assert _rounds_waited(chat, waiting, limits, arrives=12) <= 1


def test_a_starving_request_goes_first_as_one(tokenizer) -> None:
    """A request that does not fit beside others holds the room once passed over for long,
    until one of its choices starts; its other choices then wait their turn, not each in
    turn holding the room, and a small request that fits beside them starts."""
    tree = RadixTree(1 << 20, free=lambda handle: None)
    big = _choices(tokenizer, tree, "big", 3, 500)
    small = [_choices(tokenizer, tree, f"small{i}", 1, 10)[0] for i in range(2)]
    running = _choices(tokenizer, tree, "other", 1, 500)
    limits = _limits(rows=8, tokens=600)
    for generation in big:
        generation.passed_over = 8
    waiting = [*big, small[0]]

    def start(generation: Generation) -> bool:
        running.append(generation)
        return True

    admit(waiting, running, limits, lambda g: 0, start)
    assert len(running) == 1 and waiting == [*big, small[0]]  # the room is held for big[0]
    running.clear()
    admit(waiting, running, limits, lambda g: 0, start)
    assert running == [big[0], small[0]]
    assert waiting == big[1:] and [g.passed_over for g in waiting] == [0, 0]
    waiting.append(small[1])
    admit(waiting, running, limits, lambda g: 0, start)
    assert running == [big[0], *small] and waiting == big[1:]


def _decoding(generations: list[Generation]) -> list[Generation]:
    for generation in generations:
        generation.prompt_done = True
    return generations


def _chat(tokenizer, tree: RadixTree, name: str = "chat", length: int = 10) -> Generation:
    return Generation(name, list(range(10, 10 + length)), SamplingParams(max_tokens=8),
                      lambda event: None, tokenizer, tokenizer.vocab_size, tree)


@pytest.mark.parametrize("limits", [_limits(rows=4), _limits(rows=64, tokens=4 * 1020 + 10)],
                         ids=["rows", "tokens"])
def test_a_request_holding_no_row_takes_one_from_the_request_holding_the_most(
        tokenizer, limits) -> None:
    """A request's choices that fill the batch's rows (or its tokens in flight) give the
    newest of theirs up to a chat that holds none, and that chat, not the choice, gets
    the place it frees, though the choices waiting were passed over for long."""
    tree = RadixTree(1 << 20, free=lambda handle: None)
    many = _choices(tokenizer, tree, "many", 8, 1000)
    running, waiting = _decoding(many[:4]), many[4:]
    for generation in waiting:
        generation.passed_over = 100
    chat = _chat(tokenizer, tree)
    waiting.append(chat)
    freed = rows_to_free(waiting, running, limits, lambda g: 0)
    assert freed == [many[3]]
    running.remove(many[3])
    waiting.insert(0, many[3])  # as the scheduler queues a preempted generation again
    admit(waiting, running, limits, lambda g: 0, lambda g: running.append(g) is None)
    assert running == [*many[:3], chat]
    # Now every request holds a row: nothing more is freed, for the choices either.
    assert rows_to_free(waiting, running, limits, lambda g: 0) == []


def test_requests_of_one_row_each_free_none_for_a_newcomer(tokenizer) -> None:
    tree = RadixTree(1 << 20, free=lambda handle: None)
    running = _decoding([_chat(tokenizer, tree, f"chat{i}") for i in range(4)])
    waiting = [_chat(tokenizer, tree, "late")]
    assert rows_to_free(waiting, running, _limits(rows=4), lambda g: 0) == []


def test_no_row_is_freed_where_it_would_not_start_the_newcomer(tokenizer) -> None:
    """Not while the prefill window is full for its long prompt (the row would go back to
    the choice, to be freed again at the next step), nor where the request holding the
    most could free rows, but not enough KV room, without giving up its last."""
    tree = RadixTree(1 << 20, free=lambda handle: None)
    prefilling = [Generation(f"long{i}", list(range(10, 310)), SamplingParams(max_tokens=8),
                             lambda event: None, tokenizer, tokenizer.vocab_size, tree)
                  for i in range(8)]
    many = _decoding(_choices(tokenizer, tree, "many", 2, 1000))
    long_chat = _chat(tokenizer, tree, "long chat", length=300)
    assert rows_to_free([long_chat], [*prefilling, *many], _limits(rows=10),
                        lambda g: 0) == []
    assert rows_to_free([long_chat], [*prefilling, *many], _limits(rows=10),
                        lambda g: 290) == [many[1]]  # mostly cached: a short prompt
    big = Generation("big", list(range(10, 2010)), SamplingParams(max_tokens=100),
                     lambda event: None, tokenizer, tokenizer.vocab_size, tree)
    assert rows_to_free([big], many, _limits(rows=64, tokens=2 * 1020 + 1000),
                        lambda g: 0) == []


def test_a_guess_takes_no_row_and_a_prompt_still_prefilling_gives_none(tokenizer) -> None:
    tree = RadixTree(1 << 20, free=lambda handle: None)
    many = _choices(tokenizer, tree, "many", 3, 1000)
    guess = SamplingParams(max_tokens=0, temperature=0.0, readout=Readout(cache_only=True))
    next_turn = Generation("next-turn", list(range(10, 30)), guess, lambda event: None,
                           tokenizer, tokenizer.vocab_size, tree)
    _decoding(many)
    assert rows_to_free([next_turn], many, _limits(rows=3), lambda g: 0) == []
    many[2].prompt_done = False
    waiting = [next_turn, _chat(tokenizer, tree)]
    assert rows_to_free(waiting, many, _limits(rows=3), lambda g: 0) == [many[1]]
