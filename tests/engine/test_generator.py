"""The generator's own guarantees, below the scheduler: a batch of one decodes on the
sequence's plain cache, and whatever leaves the batch takes a cache holding exactly its
tokens, the same keys and values a fresh prefill of those tokens gives."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from llguidance import LLMatcher
from mlx_lm import load
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.api import Constraint, SamplingParams
from engine.generator import Generator, PrefillResult, SequenceState, segment_spans
from engine.grammar import Grammars
from engine.kv import KVSegment
from engine.sampling import Penalties
from engine.speculation import STEP_COST, Drafts, PredictionLookup
from engine.tokenizer import ModelTokenizer
from tests.faults import FaultInjectingModel


@pytest.fixture(scope="module")
def model(family_model_dir):
    return load(family_model_dir("llama"))[0]


def sequence(model, uid: int, prompt: list[int]) -> SequenceState:
    return SequenceState(uid, make_prompt_cache(model), tokens=[], unfed=list(prompt),
                    sampler=None, penalties=None, wants_logprobs=False)


def run_until_decoding(generator: Generator, *sequences: SequenceState) -> None:
    for s in sequences:
        generator.add(s)
    while generator.prefilling:
        generator.prefill(64)
    generator.decode()


def assert_cache_holds(model, cache: list, tokens: list[int]) -> None:
    fresh = make_prompt_cache(model)
    model(mx.array([tokens]), cache=fresh)
    for got, want in zip(cache, fresh):
        assert got.offset == len(tokens)
        keys, _ = got.state[:2]
        assert mx.allclose(keys[..., :len(tokens), :], want.keys[..., :len(tokens), :],
                           atol=1e-4).item()


def greedy_alone(model, prompts: list[list[int]], count: int,
                 budget: int = 64) -> dict[int, list[int]]:
    """The first `count` tokens each prompt samples when it is prefilled and decoded
    alone, by uid (its index)."""
    alone: dict[int, list[int]] = {}
    for uid, prompt in enumerate(prompts):
        generator = Generator(model)
        generator.add(sequence(model, uid, prompt))
        alone |= generate(generator, [uid], budget, count)[0]
    return alone


def test_a_lone_sequence_decodes_on_its_plain_cache(model) -> None:
    generator = Generator(model)
    first = sequence(model, 0, list(range(10, 40)))
    run_until_decoding(generator, first)
    assert type(generator.cache[0]) is KVCache
    run_until_decoding(generator, sequence(model, 1, list(range(50, 60))))
    assert type(generator.cache[0]) is BatchKVCache
    generator.remove([1])
    assert type(generator.cache[0]) is KVCache
    assert generator.rows == [first]


def test_leaving_sequences_take_exactly_their_tokens(model) -> None:
    generator = Generator(model)
    prompts = [list(range(10, 10 + n)) for n in (5, 23, 40)]
    sequences = [sequence(model, uid, p) for uid, p in enumerate(prompts)]
    run_until_decoding(generator, *sequences)
    for _ in range(3):
        generator.decode()
    for uid in (1, 0, 2):  # from the middle of a batch of three, then two, then one
        left = generator.remove([uid])[uid]
        assert left.tokens[:len(prompts[uid])] == prompts[uid]
        assert_cache_holds(model, left.cache, left.tokens)
        generator.decode()
    assert generator.rows == [] and generator.cache is None


def greedy_tokens(generator: Generator, uids: list[int], count: int) -> dict[int, list[int]]:
    """The first `count` tokens each of `uids` (prompts computed) samples from now on."""
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    while min(len(t) for t in tokens.values()) < count:
        for output in generator.decode():
            tokens[output.uid].append(output.token)
    return {uid: t[:count] for uid, t in tokens.items()}


def test_a_prompt_computed_alone_gives_its_first_token_in_its_last_prefill_step(model
                                                                              ) -> None:
    """Its last token is fed alone right after the chunk before it, which samples its
    first token and adds it to the batch beside a decoding row: the server sends that
    token at the end of this step, and nothing is left to `join` at the next. It answers
    as it does alone."""
    prompts = [list(range(10, 40)), list(range(50, 71))]
    alone = greedy_alone(model, prompts, 3)
    generator = Generator(model)
    run_until_decoding(generator, sequence(model, 0, prompts[0]))
    generator.add(sequence(model, 1, prompts[1]))
    firsts = []
    while generator.prefilling:
        result = generator.prefill(8)
        assert result.tokens == 8 or not generator.prefilling
        firsts += [(o.uid, o.token) for o in result.outputs]
    assert firsts == [(1, alone[1][0])]
    assert generator.join() == [] and [row.uid for row in generator.rows] == [0, 1]
    later: dict[int, list[int]] = {0: [], 1: []}
    while len(later[1]) < 2:
        for output in generator.decode():
            later[output.uid].append(output.token)
    assert later[1][:2] == alone[1][1:]
    assert later[0][:2] == alone[0][1:]


def test_a_grammar_waiting_for_its_marker_holds_back_no_first_token(model, family_model_dir
                                                                      ) -> None:
    """A row's first token comes out before the next decode forward (`join`). A grammar
    that constrains from the start holds it back to that forward's step, where it takes
    it in and may end the output there; one that waits for its marker (a lazy call
    grammar, a reasoning model's) cannot be ended by a token, and holds back nothing."""
    tokenizer = ModelTokenizer(load_tokenizer(Path(family_model_dir("llama"))))
    grammars = Grammars(tokenizer, model.args.vocab_size)

    def first_steps(after: str | None) -> tuple[list[int], list[int]]:
        """The row's tokens out before the first decode forward, and out of its step."""
        generator = Generator(model)
        row = sequence(model, 0, list(range(10, 40)))
        row.grammar = grammars.state(Constraint(
            LLMatcher.grammar_from_lark('start: "x" "y"*'), after))
        generator.add(row)
        before = []
        while generator.prefilling:
            before += [o.token for o in generator.prefill(64).outputs]
        before += [o.token for o in generator.join()]
        return before, [o.token for o in generator.decode()]

    waiting, constraining = first_steps("</think>"), first_steps(None)
    assert len(waiting[0]) == 1 and waiting[1] == []
    assert constraining[0] == [] and tokenizer.decode(constraining[1]) == "x"


def test_short_prompts_fitting_one_chunk_are_prefilled_together(model) -> None:
    preamble = list(range(100, 130))
    prompts = [preamble + list(range(200 + 7 * i, 200 + 7 * i + n))
               for i, n in enumerate((3, 9, 1, 6))]
    alone = greedy_alone(model, prompts, 4)

    # The preamble is cached (as a radix hit would be): only the rest is unfed, and
    # rows of different lengths are padded to the longest.
    prefix = make_prompt_cache(model)
    model(mx.array([preamble]), cache=prefix)
    generator = Generator(model)
    for uid, prompt in enumerate(prompts):
        cache = make_prompt_cache(model)
        for layer, shared in zip(cache, prefix):
            layer.update_and_fetch(shared.keys[..., :len(preamble), :],
                                   shared.values[..., :len(preamble), :])
        generator.add(SequenceState(uid, cache, tokens=list(preamble),
                                    unfed=prompt[len(preamble):], sampler=None,
                                    penalties=None, wants_logprobs=False))
    result = generator.prefill(64)
    done = result.done
    assert [s.uid for s in done] == [0, 1, 2, 3]
    assert generator.rows == done and not generator.prefilling
    for row in done:
        assert row.tokens == prompts[row.uid]
        assert_cache_holds(model, generator.caches_of([row])[0], row.tokens)
    # What the tree copies of each row past the preamble comes out of the batch in one
    # array for all layers, holding what the row's cache holds.
    start = len(preamble)
    for row, source in zip(done, generator.caches_of(done, [start] * len(done))):
        keys, values = source.span(start, len(row.tokens))
        for layer, view in enumerate(generator.caches_of([row])[0]):
            assert mx.array_equal(keys[layer], view.keys[..., start:, :]).item()
            assert mx.array_equal(values[layer], view.values[..., start:, :]).item()
    with pytest.raises(ValueError):  # the tokens before `start` were not read
        generator.caches_of(done[:1], [start])[0].span(start - 1, start)
    # Their first tokens come with the prefill, the rest from decode steps.
    assert [o.uid for o in result.outputs] == [0, 1, 2, 3]
    later = greedy_tokens(generator, [0, 1, 2, 3], 3)
    assert {o.uid: [o.token, *later[o.uid]] for o in result.outputs} == alone


def test_turns_behind_cached_histories_prefilled_together_answer_as_alone(model) -> None:
    # Three chats' next turns, as the radix tree hands them over: each history's KV in
    # segments, the first shared by two chats (one system prompt), the rest each chat's
    # own; one chat's segments stacked over layers, as those copied out of a batch are.
    # Turns of different lengths, so the shorter ones feed the end of their own history
    # again rather than padding, and the shared segment stays where both rows have it.
    system = list(range(100, 124))
    histories = [system + list(range(300, 317)), system + list(range(400, 405)),
                 list(range(500, 530))]
    turns = [list(range(600, 609)), list(range(700, 703)), list(range(800, 806))]
    prompts = [h + t for h, t in zip(histories, turns)]
    alone = greedy_alone(model, prompts, 4)

    def computed(tokens: list[int]) -> list:
        cache = make_prompt_cache(model)
        model(mx.array([tokens]), cache=cache)
        return cache

    shared = KVSegment.from_cache(computed(system), 0, len(system))
    prefixes = []
    for history in histories:
        cache = computed(history)
        if history[:len(system)] == system:
            prefixes.append([shared, KVSegment.from_cache(cache, len(system), len(history))])
        else:
            own = KVSegment.from_cache(cache, 0, len(history))
            prefixes.append([KVSegment(mx.stack(own.keys), mx.stack(own.values))])
    generator = Generator(model)
    for uid, (history, turn, prefix) in enumerate(zip(histories, turns, prefixes)):
        generator.add(SequenceState(uid, None, tokens=list(history), unfed=list(turn),
                                    sampler=None, penalties=None, wants_logprobs=False,
                                    prefix=prefix))
    result = generator.prefill(64)
    assert sorted(s.uid for s in result.done) == [0, 1, 2] and not generator.prefilling
    for row in result.done:
        assert row.tokens == prompts[row.uid]
        assert_cache_holds(model, generator.caches_of([row])[0], row.tokens)
    later = greedy_tokens(generator, [0, 1, 2], 3)
    assert {o.uid: [o.token, *later[o.uid]] for o in result.outputs} == alone


def prefill_all(generator: Generator, budget: int) -> list[PrefillResult]:
    results = []
    while generator.prefilling:
        results.append(generator.prefill(budget))
    return results


def generate(generator: Generator, uids: list[int], budget: int, count: int
             ) -> tuple[dict[int, list[int]], list[int]]:
    """Prefill everything in chunks of `budget`, then decode: the first `count` tokens of
    each of `uids` (prompts prefilled together output their first with the prefill), and
    the uids whose prefill failed."""
    results = prefill_all(generator, budget)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    for output in (o for r in results for o in r.outputs):
        tokens[output.uid].append(output.token)
    while min(len(t) for t in tokens.values()) < count:
        for output in generator.decode():
            tokens[output.uid].append(output.token)
    failed = [s.uid for r in results for s, _ in r.failed]
    return {uid: t[:count] for uid, t in tokens.items()}, failed


def test_prompts_computed_in_successive_steps_join_the_batch_together(model) -> None:
    """The first of two prompts being computed does not join alone once finished, nor
    the second with the first ready: both join at the next decode, in one forward, as a
    burst's prompts do (a forward each cost the CPU's multi-turn 10% of ITL)."""
    prompts = [list(range(10, 110)), list(range(200, 210))]
    alone = greedy_alone(model, prompts, 3)
    generator = Generator(model)
    generator.add(sequence(model, 0, prompts[0]))
    generator.prefill(64)
    generator.add(sequence(model, 1, prompts[1]))
    while generator.prefilling:
        assert generator.prefill(64).outputs == []
    assert [s.uid for s in generator.ready] == [0, 1] and generator.rows == []
    assert generate(generator, [0, 1], 64, 3)[0] == alone


def long_prompts() -> list[list[int]]:
    return [list(range(10 + 3 * i, 10 + 3 * i + n)) for i, n in enumerate((300, 320, 290))]


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_prompts_computed_one_by_one_join_the_batch_together_and_answer_as_alone(
        family, family_model_dir) -> None:
    # Sliding-window and recurrent caches are prefilled one prompt at a time, so prompts
    # computed in successive steps are all ready at the next decode step, where they join
    # in one forward. Longer and shorter than the 32-token window, beside a row decoding.
    model = load(family_model_dir(family))[0]
    prompts = [list(range(10 + 3 * i, 10 + 3 * i + n)) for i, n in enumerate((20, 45, 7, 70))]
    alone = greedy_alone(model, prompts, 5, budget=128)

    generator = Generator(model)
    generator.add(sequence(model, 0, prompts[0]))
    generator.prefill(128)
    together: dict[int, list[int]] = {uid: [] for uid in range(len(prompts))}
    together[0] = [output.token for output in generator.decode() + generator.decode()]
    for uid, prompt in enumerate(prompts[1:], start=1):
        generator.add(sequence(model, uid, prompt))
    while generator.prefilling:
        generator.prefill(128)
    assert [s.uid for s in generator.ready] == [1, 2, 3] and len(generator.rows) == 1
    while min(map(len, together.values())) < 5:
        for output in generator.decode():
            together[output.uid].append(output.token)
    assert {uid: tokens[:5] for uid, tokens in together.items()} == alone
    for uid in (2, 0, 3, 1):  # each leaves with a cache holding its tokens
        generator.remove([uid])
        generator.decode()


def test_prompts_a_step_can_finish_go_ahead_of_a_long_one_every_other_step(model) -> None:
    # A 400-token document, then a short prompt arriving before each step: the short
    # ones go first (two waiting are computed together) and the document takes every
    # other step's whole budget. Each answers as it would alone.
    document = list(range(10, 410))
    shorts = [list(range(20 + uid, 40 + uid)) for uid in range(1, 7)]
    alone = greedy_alone(model, [document, *shorts], 2, budget=512)
    generator = Generator(model)
    long = sequence(model, 0, document)
    generator.add(long)
    generator.prefill(64)
    fed, done, firsts = [], [], {}
    for uid, prompt in enumerate(shorts, start=1):
        generator.add(sequence(model, uid, prompt))
        before = len(long.tokens)
        result = generator.prefill(64)
        fed.append(len(long.tokens) - before)
        done.append([s.uid for s in result.done])
        firsts |= {output.uid: output.token for output in result.outputs}  # grouped rows'
    assert fed == [0, 64, 0, 64, 0, 64]
    assert done == [[1], [], [2, 3], [], [4, 5], []]
    tokens, failed = generate(generator, list(range(7)), 64, 2)
    assert failed == []
    assert {uid: [firsts[uid], *t][:2] if uid in firsts else t
            for uid, t in tokens.items()} == alone


def test_short_prompts_past_the_chunk_in_all_are_prefilled_together_within_together(
        model) -> None:
    # The next turns of chats that ended together, at an idle engine whose chunk is
    # small (a CPU's): each turn within the chunk, more than it in all. They are computed
    # in one forward of up to `together` tokens and answer as they do alone; a prompt
    # longer than the chunk is not taken with them.
    prompts = [list(range(300 + 50 * i, 300 + 50 * i + n))
               for i, n in enumerate((30, 24, 28, 20, 45))]
    alone = greedy_alone(model, prompts[:4], 3, budget=32)

    generator = Generator(model)
    for uid, prompt in enumerate(prompts):
        generator.add(sequence(model, uid, prompt))
    result = generator.prefill(32, together=128)
    assert [s.uid for s in result.done] == [0, 1, 2, 3]
    assert result.tokens == 4 * 30  # right-padded to the longest
    assert [o.uid for o in result.outputs] == [0, 1, 2, 3]
    assert [s.uid for s in generator.prefilling] == [4]
    later = greedy_tokens(generator, [0, 1, 2, 3], 2)
    assert {o.uid: [o.token, *later[o.uid]] for o in result.outputs} == {
        uid: alone[uid] for uid in range(4)}

    # Within the chunk in all, as while others decode: one prompt a forward.
    generator = Generator(model)
    for uid, prompt in enumerate(prompts[:4]):
        generator.add(sequence(model, uid, prompt))
    assert [s.uid for s in generator.prefill(32).done] == [0]


def test_prompts_too_long_for_one_forward_take_equal_chunks_together(model) -> None:
    prompts = long_prompts()
    alone = {}
    for uid, prompt in enumerate(prompts):
        generator = Generator(model)
        generator.add(sequence(model, uid, prompt))
        alone |= generate(generator, [uid], 200, 4)[0]

    generator = Generator(model)
    sequences = [sequence(model, uid, p) for uid, p in enumerate(prompts)]
    for s in sequences:
        generator.add(s)
    # 200 tokens cannot finish the first prompt: each of the three takes 66 of them.
    first = generator.prefill(200)
    assert (first.tokens, first.done, first.failed) == (198, [], [])
    assert [len(s.tokens) for s in sequences] == [66, 66, 66]
    for s in sequences:
        assert_cache_holds(model, s.cache, s.tokens)
    assert generate(generator, [0, 1, 2], 200, 4) == (alone, [])


def test_a_prompt_whose_forward_fails_fails_alone_in_a_group(model) -> None:
    prompts = long_prompts()
    fault = 5  # below every prompt's tokens
    prompts[1][100] = fault
    alone = {}
    for uid in (0, 2):
        generator = Generator(model)
        generator.add(sequence(model, uid, prompts[uid]))
        alone |= generate(generator, [uid], 200, 4)[0]

    generator = Generator(FaultInjectingModel(model, fault))
    for uid, prompt in enumerate(prompts):
        generator.add(sequence(model, uid, prompt))
    assert generate(generator, [0, 2], 200, 4) == (alone, [1])


def drafting(model, uid: int, prompt: list[int], mode: str, looked: list[tuple[int, int]]):
    """A sequence whose drafts come from a source that always guesses wrong, and which
    records when it was asked: its uid and the context's length."""

    def wrong(context: list[int], limit: int) -> list[int]:
        looked.append((uid, len(context)))
        return [(context[-1] + 1 + i) % 1000 for i in range(limit)]

    state = sequence(model, uid, prompt)
    state.drafts = Drafts(mode, 8, ("tree",), wrong, end=1 << 20, vocab_size=1000)
    return state


def test_a_gpu_batch_stops_drafting_what_does_not_pay_but_on_rows_still_draft(
        model) -> None:
    """Pipelined (as on a GPU), drafts that always fail: auto rows pause, longer each
    time, and probe together; a row whose mode is `on` drafts at every step; and either
    way each row's tokens are the ones it decodes without speculation."""
    prompts = [list(range(10 + n, 40 + n)) for n in range(4)]
    generator = Generator(model)
    run_until_decoding(generator, *(sequence(model, uid, p) for uid, p in enumerate(prompts)))
    plain = greedy_tokens(generator, list(range(4)), 40)
    for modes in (["auto"] * 4, ["on", "auto", "auto", "auto"]):
        generator = Generator(model)
        generator.pipelined = True
        looked: list[tuple[int, int]] = []
        run_until_decoding(generator, *(drafting(model, uid, p, mode, looked)
                                        for uid, (p, mode) in enumerate(zip(prompts, modes))))
        assert greedy_tokens(generator, list(range(4)), 40) == plain
        if modes[0] == "on":  # its drafts all fail: one token a step, a look a step
            assert sum(uid == 0 for uid, _ in looked) >= 39
        else:  # 4 rows looking at every step would look 160 times, at 40 steps
            assert len(looked) <= 24
            # The prompts are as long, so a context's length names the step: the rows
            # paused alike probe at the same steps.
            steps = {length for _, length in looked}
            assert len(looked) == 4 * len(steps)


@pytest.mark.parametrize("penalized", [False, True])
def test_a_gpu_batch_whose_rows_find_no_drafts_holds_off_looks_that_wait(
        model, penalized: bool) -> None:
    """Short answers that never repeat, rows joining one after another: each row looks at
    its first steps and probes after its pauses, so some row looks at most steps. A look
    on a GPU guesses past the token being computed and waits for nothing; where rows'
    penalties need that token read, each look waits for the device, and one that finds
    nothing holds the whole batch off. The rows answer as without speculation."""
    prompts = [list(range(10 + n, 40 + n)) for n in range(6)]
    step = [0]
    looked_at: set[int] = set()

    def nothing(context: list[int], limit: int) -> list[int]:
        looked_at.add(step[0])
        return []

    def run(drafting: bool) -> dict[int, list[int]]:
        generator = Generator(model)
        generator.pipelined = True
        tokens: dict[int, list[int]] = {uid: [] for uid in range(len(prompts))}
        for uid, prompt in enumerate(prompts):
            state = sequence(model, uid, prompt)
            if penalized:
                state.penalties = Penalties(SamplingParams(max_tokens=64, presence_penalty=0.5),
                                            len(prompt))
            if drafting:
                state.drafts = Drafts("auto", 8, ("tree",), nothing, end=1 << 20,
                                      vocab_size=1000)
            generator.add(state)
            for _ in range(6):
                while generator.prefilling:
                    generator.prefill(64)
                for output in generator.decode():
                    tokens[output.uid].append(output.token)
                step[0] += 1
        while min(map(len, tokens.values())) < 32:
            for output in generator.decode():
                tokens[output.uid].append(output.token)
            step[0] += 1
        return {uid: t[:32] for uid, t in tokens.items()}

    plain = run(drafting=False)
    step[0] = 0
    assert run(drafting=True) == plain
    assert step[0] >= 60
    # Each row on its own looks at its first two steps and after pauses of 4, 8 and 16
    # steps: 5 looks in its first 32 steps, 25 steps of 63 for 6 rows joined 6 steps
    # apart. Held off 4, 8, 16 and 32 steps, the batch looks at 5.
    assert len(looked_at) <= 6 if penalized else len(looked_at) >= 20


def test_a_gpu_look_drafts_past_the_token_being_computed(model) -> None:
    """Pipelined, the last step's tokens are still being computed when the next is built:
    a look drafts from the tokens read, its first guessed token standing for the one fed.
    A source that always guesses that token wrong and the rest right has the rest kept
    (each is checked after the true token), and the rows answer as without drafts."""
    prompts = [list(range(10 + n, 40 + n)) for n in range(3)]
    alone = greedy_alone(model, prompts, 24)
    contexts = {tuple(p): p + alone[uid] for uid, p in enumerate(prompts)}

    def wrong_then_right(context: list[int], limit: int) -> list[int]:
        full = contexts[tuple(context[:30])]
        ahead = full[len(context):len(context) + limit]
        return [ahead[0] ^ 1, *ahead[1:]] if ahead else []

    generator = Generator(model)
    generator.pipelined, generator.step_cost = True, STEP_COST["gpu"]
    for uid, prompt in enumerate(prompts):
        state = sequence(model, uid, prompt)
        state.drafts = Drafts("auto", 8, ("tree",), wrong_then_right, end=1 << 20,
                              vocab_size=1 << 20)
        generator.add(state)
    tokens = {uid: [] for uid in range(len(prompts))}
    for output in (o for r in prefill_all(generator, 64) for o in r.outputs):
        tokens[output.uid].append(output.token)
    while min(map(len, tokens.values())) < 24:
        for output in generator.decode():
            tokens[output.uid].append(output.token)
    assert {uid: t[:24] for uid, t in tokens.items()} == alone
    assert generator.counters.accepted_draft_tokens > 0


def test_a_row_with_a_prediction_is_looked_at_as_it_joins_a_held_off_batch(model) -> None:
    """The batch holds off looking after a look found nothing; a row that brings a
    prediction (the client's expected answer) ends the hold-off as it joins."""
    prompts = [list(range(10, 40)), list(range(60, 90))]
    alone = greedy_alone(model, prompts, 12)
    looks: list[int] = []

    class Watched(PredictionLookup):
        def draft(self, context: list[int], limit: int) -> list[int]:
            looks.append(len(context))
            return super().draft(context, limit)

    generator = Generator(model)
    generator.pipelined = True
    guessless = sequence(model, 0, prompts[0])
    guessless.drafts = Drafts("auto", 8, ("tree",), lambda context, limit: [],
                              end=1 << 20, vocab_size=1 << 20)
    run_until_decoding(generator, guessless)
    generator.decode()  # looks, finds nothing: held off
    predicted = sequence(model, 1, prompts[1])
    predicted.drafts = Drafts("auto", 8, ("tree",), lambda context, limit: [],
                              end=1 << 20, vocab_size=1 << 20,
                              prediction=Watched(alone[1], len(prompts[1])))
    generator.add(predicted)
    tokens = [o.token for r in prefill_all(generator, 64) for o in r.outputs if o.uid == 1]
    while not looks:
        tokens += [o.token for o in generator.decode() if o.uid == 1]
    assert len(tokens) <= 2  # its first steps
    while len(tokens) < 12:
        tokens += [o.token for o in generator.decode() if o.uid == 1]
    assert tokens[:12] == alone[1]


def test_segments_holding_fewer_tokens_than_asked_are_refused() -> None:
    """A path whose node left memory has no segment for its tokens: reading on past the
    gap would attend over other positions' KV."""
    segment = SimpleNamespace(keys=[], values=[], length=10)  # what a span reads of one
    assert [n for _, _, n in segment_spans([segment, segment], 15)] == [10, 5]
    with pytest.raises(ValueError, match="hold 20 of 25 tokens"):
        segment_spans([segment, segment], 25)
