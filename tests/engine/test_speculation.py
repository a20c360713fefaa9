"""Speculative decoding: greedy output is token-identical to decoding without it, for each
draft source, under batching, with grammars, stop strings and logprobs; the draft
sources and the rejection step on their own are in test_speculation_units.py.

On the tiny random-weight demo model drafts from prompt lookup are mostly rejected (its
output does not repeat its prompt), which exercises rollback; a request repeated gets the
first one's output from the radix tree as its draft, all of it accepted. The real default
model copies a file it is asked to repeat, so its drafts are mostly accepted.
"""

from __future__ import annotations

import asyncio

import pytest
from llguidance import LLMatcher

from engine.api import Constraint, SpeculationConfig
from engine.constraints import json_schema
from engine.generator import Generator
from tests.engine.kv_integrity import check_tree_kv
from tests.engine.support import Reference, as_on_a_gpu, complete, settled, start_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

FILE = "".join(f"def handler_{i}(request):\n    value = request.get('field_{i}')\n"
               f"    if value is None:\n        return error('missing field_{i}')\n"
               f"    return ok(value * {i})\n\n" for i in range(4))


def edit_prompt(engine, old: str, new: str) -> list[int]:
    """The agent edit workload's request: repeat a file with one change."""
    return engine.tokenizer.chat_prompt([{"role": "user", "content": (
        f"Here is a file:\n```python\n{FILE}```\nRepeat the whole file exactly, but "
        f"rename {old} to {new}. Output only the code.")}])


# -- the demo model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(demo_model_dir) -> Reference:
    return Reference(str(demo_model_dir))


@pytest.fixture(scope="module", params=["prompt", "tree", "model", "tree, GPU steps"])
def engine(request, demo_model_dir):
    """Drafts from one source; the draft model is the demo model itself (other weights
    are in test_draft_model.py). "GPU steps" runs the GPU's paths here: on an H200 they
    once cut an answer whose grammar a verified draft completed at its first token."""
    source = request.param.split(",")[0]
    draft_model = str(demo_model_dir) if source == "model" else ""
    with pytest.MonkeyPatch.context() as patch:
        if request.param.endswith("GPU steps"):
            patch.setattr(Generator, "__init__", as_on_a_gpu(Generator.__init__))
        engine = start_engine(str(demo_model_dir), cache_bytes=1 << 30, speculation=(
            SpeculationConfig(mode="on", sources=(source,), draft_model=draft_model)))
    yield engine
    engine.shutdown()


def drafts_from_tree(engine) -> bool:
    return engine._scheduler.speculation.sources == ("tree",)


def encode(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, special_tokens=False)


async def test_greedy_is_identical_under_batching(engine, reference, demo_model_dir):
    """Requests decoded together, some repeated (the tree drafts their whole output) and
    some new (drafts rejected): every row's cache drops a different number of positions
    at a step, and what the rows leave in the tree is still exactly their tokens' KV."""
    prompts = [encode(engine, f"{FILE} # variant {i} " * (1 + i % 2)) for i in range(4)]
    want = [reference.greedy(p, 32) for p in prompts]
    await complete(engine, prompts[0], 32)
    await complete(engine, prompts[2], 32)
    before = engine.stats().counters
    got = await asyncio.gather(*(complete(engine, p, 32) for p in prompts))
    assert [g.tokens for g in got] == want
    counters = (await settled(engine)).counters
    assert counters.draft_tokens > before.draft_tokens
    if drafts_from_tree(engine):
        for repeated in (got[0].finish, got[2].finish):
            assert repeated.accepted_draft_tokens == repeated.draft_tokens >= 24
    check_tree_kv(engine, reference.model)


async def test_a_prediction_of_the_answer_is_kept_whole_and_a_wrong_one_changes_nothing(
        engine, reference):
    """A request's prediction is its first draft source: a prediction of the very answer
    is accepted token for token, under batching with a request whose prediction is
    wrong, and both answer as without one."""
    prompts = [encode(engine, f"Predicted outputs, case {i}: ") for i in range(2)]
    want = [reference.greedy(p, 24) for p in prompts]
    right, wrong = await asyncio.gather(
        complete(engine, prompts[0], 24, prediction=tuple(want[0])),
        complete(engine, prompts[1], 24, prediction=(want[1][0], *range(100, 140))))
    assert [right.tokens, wrong.tokens] == want
    assert right.finish.accepted_prediction_tokens == right.finish.prediction_tokens >= 20
    # Its first token is the answer's, and nothing after it is.
    assert wrong.finish.prediction_tokens > 0 == wrong.finish.accepted_prediction_tokens


async def test_a_stop_inside_an_accepted_prediction_counts_only_what_was_output(
        engine, reference):
    """A verify accepts the whole predicted answer, and a stop token within it ends the
    reply there: the tokens after it were never output, so they are not accepted ones
    (accepted prediction tokens once outnumbered the completion's)."""
    prompt = encode(engine, "Predicted, then stopped: ")
    want = reference.greedy(prompt, 24)
    stop = next(token for token in want[4:] if token not in want[:4])
    stopped = await complete(engine, prompt, 24, prediction=tuple(want),
                             stop_token_ids=(stop,))
    assert stopped.tokens == want[:want.index(stop)]
    finish = stopped.finish
    assert finish.matched_stop == stop
    assert finish.accepted_prediction_tokens <= finish.accepted_draft_tokens <= \
        finish.completion_tokens


async def test_auto_drafts_a_repeated_request_and_keeps_its_answer(engine, reference):
    prompt = encode(engine, "Auto mode, asked twice: what is a fjord? ")
    first = await complete(engine, prompt, 24, speculation="auto")
    second = await complete(engine, prompt, 24, speculation="auto")
    assert first.tokens == second.tokens == reference.greedy(prompt, 24)
    if drafts_from_tree(engine):
        assert second.finish.accepted_draft_tokens == second.finish.draft_tokens > 0


async def test_a_grammar_with_speculation(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "count": {"type": "integer"}},
              "required": ["name", "count"]}
    prompt = encode(engine, "Write the tool call as JSON: ")
    first = await complete(engine, prompt, 40, constraint=json_schema(schema))
    second = await complete(engine, prompt, 40, constraint=json_schema(schema))
    plain = await complete(engine, prompt, 40, constraint=json_schema(schema), speculation="off")
    assert first.tokens == second.tokens == plain.tokens
    assert first.finish.reason == plain.finish.reason
    if drafts_from_tree(engine):
        assert second.finish.accepted_draft_tokens > 0


async def test_a_draft_across_a_grammars_marker_is_checked_after_it(engine):
    """The free output, repeated, is drafted from the tree past the marker where the
    grammar starts: the grammar cuts the draft there."""
    prompt = encode(engine, "Think first, then answer: ")
    free = await complete(engine, prompt, 12, ignore_eos=True, speculation="off")
    at, marker = next((i, engine.tokenizer.decode([t])) for i, t in enumerate(free.tokens)
                      if i >= 3 and encode(engine, engine.tokenizer.decode([t])) == [t])
    constraint = Constraint(LLMatcher.grammar_from_lark('start: "yes" | "no"'), marker)
    plain = await complete(engine, prompt, 30, constraint=constraint, speculation="off")
    drafted = await complete(engine, prompt, 30, constraint=constraint)
    assert drafted.tokens == plain.tokens
    assert drafted.tokens[:at + 1] == free.tokens[:at + 1]
    assert engine.tokenizer.decode(drafted.tokens[at + 1:]) in ("yes", "no")
    if drafts_from_tree(engine):
        assert drafted.finish.accepted_draft_tokens >= at


async def test_stop_strings_and_max_tokens_cut_where_they_do_without(engine):
    prompt = encode(engine, "Count the rivers of the valley: one, two, ")
    plain = await complete(engine, prompt, 30, speculation="off")
    stop = plain.text[10:14]
    plain_stopped = await complete(engine, prompt, 30, speculation="off", stop=(stop,))
    for _ in range(2):  # the second one is drafted from the first, past the stop
        stopped = await complete(engine, prompt, 30, stop=(stop,))
        assert (stopped.text, stopped.finish.reason) == (plain_stopped.text, "stop")
        assert stopped.tokens == plain_stopped.tokens
    if drafts_from_tree(engine):
        assert stopped.finish.accepted_draft_tokens > 0
    short = await complete(engine, prompt, 7)
    assert short.tokens == plain.tokens[:7]
    assert short.finish.reason == "length"


async def test_logprobs_of_accepted_tokens(engine):
    prompt = encode(engine, "Logprobs of a repeated answer, please: ")
    plain = await complete(engine, prompt, 12, speculation="off", logprobs=2)
    drafted = await complete(engine, prompt, 12, logprobs=2)
    assert drafted.tokens == plain.tokens
    for a, b in zip(drafted.events, plain.events):
        assert a.logprob.logprob == pytest.approx(b.logprob.logprob, abs=1e-4)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


async def test_a_seeded_sampled_request_gives_the_same_tokens_with_drafts(engine):
    """A sampled row keeps a draft token where it is the token its sampler draws at that
    output index from the seed's noise (test_speculation_units.py), so a seeded request
    is reproducible with or without drafts: repeated, it is drafted from the tree (its
    first run's output) and keeps every draft token."""
    prompt = encode(engine, "A sampled answer about the sea: ")
    knobs = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}
    plain = await complete(engine, prompt, 24, speculation="off", seed=0, **knobs)
    results = await asyncio.gather(*(complete(engine, prompt, 24, seed=seed, **knobs)
                                     for seed in range(3)))
    assert results[0].tokens == plain.tokens
    assert all(len(r.tokens) == 24 or r.finish.reason == "stop" for r in results)
    if drafts_from_tree(engine):
        assert results[0].finish.accepted_draft_tokens == results[0].finish.draft_tokens > 0


# -- the real default model ------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_model_engine(real_model_dir):
    """On with a draft model (the only real model of its tokenizer here is itself)."""
    engine = start_engine(str(real_model_dir), cache_bytes=1 << 30, speculation=(
        SpeculationConfig(mode="on", sources=("model",), draft_model=str(real_model_dir))))
    yield engine
    engine.shutdown()


async def test_the_real_model_copies_a_file_identically_with_drafts(real_engine,
                                                                    draft_model_engine):
    """Two edits of one file decoded together, with drafts from prompt lookup and the
    tree or from a draft model, give the tokens they give without speculation, most
    drafts accepted. Off and on with prompt lookup and the tree are the conftest's engine
    (off by default) with each request's mode, its cache emptied between them: the tree
    holds no earlier answer to draft from, as a fresh engine's would not (an engine whose
    own mode is on is the demo model's above)."""
    edits = [("handler_1", "handle_one"), ("handler_2", "handle_two")]
    results = []
    for engine, mode in ((real_engine, "off"), (real_engine, "on"), (draft_model_engine, None)):
        await asyncio.wrap_future(engine.clear_cache())
        prompts = [edit_prompt(engine, *edit) for edit in edits]
        results.append(await asyncio.gather(*(complete(engine, p, 48, speculation=mode)
                                              for p in prompts)))
    off, *drafted = [[r.tokens for r in result] for result in results]
    assert drafted == [off, off]
    for result in results[1:]:
        finish = [r.finish for r in result]
        assert (sum(f.accepted_draft_tokens for f in finish)
                > sum(f.draft_tokens for f in finish) / 2)


async def test_the_real_model_edits_a_file_identically_with_the_file_as_prediction(real_engine):
    """OpenAI's Predicted Outputs on an engine whose speculation is off: the file the edit
    is asked of is the prediction, drafts come from it (in auto mode) past the code fence
    and the edit, most of them kept, and the answer is the one without it."""
    await asyncio.wrap_future(real_engine.clear_cache())
    prompt = edit_prompt(real_engine, "handler_1", "handle_one")
    plain = await complete(real_engine, prompt, 64)
    await asyncio.wrap_future(real_engine.clear_cache())
    predicted = await complete(real_engine, prompt, 64, prediction=tuple(encode(real_engine, FILE)))
    assert predicted.tokens == plain.tokens
    assert plain.finish.draft_tokens == 0
    finish = predicted.finish
    assert finish.draft_tokens >= finish.prediction_tokens > 0
    assert finish.accepted_prediction_tokens > finish.prediction_tokens / 2
