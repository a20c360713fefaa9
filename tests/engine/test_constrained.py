"""Constrained decoding in the engine, on the tiny random-weights model.

Its weights are random, so whatever structure its output has comes from the grammar
alone: a strong test that the mask is applied at every step, from the first token on.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from functools import partial

import jsonschema
import pytest
from llguidance import LLMatcher
from mlx_lm.tool_parsers import json_tools

import engine.grammar as engine_grammar
from engine.api import Constraint, ConstraintUnmet, RequestFailed, SamplingParams, TokenEvent
from engine.constraints import (
    FunctionTool,
    JsonAnswer,
    json_object,
    json_schema,
    regex,
    tool_calls,
)
from tests.engine.support import cancel_after, complete, settled, start_engine
from tests.faults import faulty_loader

pytestmark = pytest.mark.asyncio(loop_scope="module")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "admin"],
    "additionalProperties": False,
}
WEATHER = FunctionTool("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})
CLOCK = FunctionTool("get_time", {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
    "required": ["zone"], "additionalProperties": False})


def lark(grammar: str, after: str | None = None) -> Constraint:
    return Constraint(LLMatcher.grammar_from_lark(grammar), after)


@pytest.fixture(scope="module")
def family() -> str:
    """The conftest's `engine` and `reference` on the plain-KV model only: the grammar,
    not the cache kind, is under test here."""
    return "llama"


def prompt_of(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, special_tokens=False)


async def test_greedy_output_validates_against_the_schema(engine):
    before = engine.stats().counters.constrained_requests
    result = await complete(engine, prompt_of(engine, "Describe a user as JSON."), 120,
                            constraint=json_schema(PERSON, strict=True))
    jsonschema.validate(json.loads(result.text), PERSON)
    assert result.finish.reason == "stop"
    assert engine.stats().counters.constrained_requests == before + 1


async def test_sampled_output_validates_too(engine):
    for seed in range(3):
        result = await complete(engine, prompt_of(engine, "A user, sampled."), 120,
                                temperature=1.0, seed=seed,
                                constraint=json_schema(PERSON, strict=True))
        jsonschema.validate(json.loads(result.text), PERSON)


async def test_json_object_is_an_object(engine):
    result = await complete(engine, prompt_of(engine, "Any JSON object."), 60,
                            constraint=json_schema({
                                "type": "object", "additionalProperties": {
                                    "type": "string", "maxLength": 6}, "maxProperties": 2}))
    assert isinstance(json.loads(result.text), dict)
    assert json_object().grammar  # the builder the server uses for json_object


@pytest.mark.parametrize("name", [None, "get_time"])
async def test_forced_tool_call_is_valid(engine, name):
    tools = [WEATHER, CLOCK]
    result = await complete(engine, prompt_of(engine, "Call a tool."), 80,
                            constraint=tool_calls(tools, name=name))
    assert result.finish.reason == "stop"
    start, end = json_tools.tool_call_start, json_tools.tool_call_end
    assert result.text.startswith(start) and result.text.endswith(end)
    call = json_tools.parse_tool_call(result.text[len(start):-len(end)])
    tool = {t.name: t for t in tools}[call["name"]]
    assert name is None or call["name"] == name
    jsonschema.validate(call["arguments"], tool.parameters)


async def test_parallel_tool_calls_are_each_valid(engine):
    tools = {t.name: t for t in (WEATHER, CLOCK)}
    result = await complete(engine, prompt_of(engine, "Call tools."), 300,
                            constraint=tool_calls(list(tools.values()), parallel=True))
    start, end = json_tools.tool_call_start, json_tools.tool_call_end
    parts = result.text.split(start)[1:]
    if result.finish.reason == "length":  # the last call may be cut short
        parts = parts[:-1]
    assert parts
    for part in parts:
        call = json_tools.parse_tool_call(part.split(end)[0])
        jsonschema.validate(call["arguments"], tools[call["name"]].parameters)


@pytest.mark.parametrize("opening", ["{", "<"])
async def test_tool_calls_or_a_json_answer(engine, opening):
    """Tools offered beside an output schema: the reply is calls or the answer. Pushing
    the model toward the answer's `{` or the call tag's `<` shows both branches."""
    tools = {t.name: t for t in (WEATHER, CLOCK)}
    [token] = prompt_of(engine, opening)
    result = await complete(engine, prompt_of(engine, "Answer or call."), 300,
                            logit_bias={token: 100.0},
                            constraint=tool_calls(list(tools.values()), parallel=False,
                                                  answer=JsonAnswer(PERSON, strict=True)))
    assert result.finish.reason == "stop"
    start, end = json_tools.tool_call_start, json_tools.tool_call_end
    if opening == "{":
        jsonschema.validate(json.loads(result.text), PERSON)
        return
    assert result.text.startswith(start) and result.text.endswith(end)
    call = json_tools.parse_tool_call(result.text[len(start):-len(end)])
    jsonschema.validate(call["arguments"], tools[call["name"]].parameters)


def keys_of(text: str) -> list[list[str]]:
    """Every object's keys in the JSON `text`, in order, repeats included."""
    found: list[list[str]] = []
    json.loads(text, object_pairs_hook=lambda pairs: found.append([k for k, _ in pairs]))
    return found


async def test_an_open_object_repeats_no_key(engine):
    """Pushed toward `"` (the empty key, closed at once) and `,` (one more key), the
    model wrote {"": 1, "$": 6, "": 0} before keys were checked."""
    quote, comma, letter = (prompt_of(engine, c)[0] for c in '",a')
    schema = {"type": "object", "maxProperties": 3,
              "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}
    result = await complete(engine, prompt_of(engine, "Keys."), 40,
                            logit_bias={quote: 100.0, comma: 50.0, letter: 40.0},
                            constraint=json_schema(schema))
    [keys] = keys_of(result.text)
    assert len(keys) == 3 and len(set(keys)) == 3 and "" in keys
    jsonschema.validate(json.loads(result.text), schema)


async def test_the_mask_applies_from_the_first_token_and_completion_stops(engine):
    prompt = prompt_of(engine, "Say the words.")
    free = await complete(engine, prompt, 8, ignore_eos=True)
    assert not free.text.startswith("hello")
    forced = await complete(engine, prompt, 50, constraint=lark('start: "hello world"'))
    assert forced.text == "hello world"
    assert (forced.finish.reason, forced.finish.matched_stop) == ("stop", None)
    assert forced.finish.completion_tokens == len(forced.tokens) < 50


async def test_constrained_one_word_answers_computed_together_stop_at_the_grammar(engine):
    # A classifier's list: short prompts behind one instruction, computed in one forward,
    # each answer a choice the grammar ends on.
    preamble = prompt_of(engine, "Answer a or b: is this sentence about the weather?\n")
    await complete(engine, preamble + prompt_of(engine, "It rains."), 1)
    sentences = ["The sun is out.", "I like tea.", "Snow fell all night.", "Dogs bark."]
    results = await asyncio.gather(*(
        complete(engine, preamble + prompt_of(engine, text), 10,
                 constraint=lark('start: "a" | "b"')) for text in sentences))
    for result in results:
        assert result.text in ("a", "b")
        assert (result.finish.reason, result.finish.completion_tokens) == (
            "stop", len(result.tokens))


async def test_eos_only_where_the_grammar_accepts(engine):
    eos = min(engine.tokenizer.eos_token_ids)
    pushed = await complete(engine, prompt_of(engine, "Letters."), 30,
                            constraint=lark('start: "ab" "c"*'), logit_bias={eos: 100.0})
    # EOS is the model's favourite by far, but only allowed once "ab" is complete.
    assert pushed.text == "ab"
    assert (pushed.finish.reason, pushed.finish.matched_stop) == ("stop", eos)


async def test_free_rows_beside_constrained_ones_keep_their_greedy_output(engine, reference):
    free = [prompt_of(engine, text) for text in (
        "A free prompt about trains.", "Another, about the sea and its tides.", "x")]
    constrained = [prompt_of(engine, f"Constrained prompt number {i}.") for i in range(3)]
    results = await asyncio.gather(
        *(complete(engine, p, 20) for p in free),
        *(complete(engine, p, 120, constraint=json_schema(PERSON, strict=True))
          for p in constrained))
    for prompt, result in zip(free, results):
        assert result.tokens == reference.greedy(prompt, 20)
    for result in results[len(free):]:
        jsonschema.validate(json.loads(result.text), PERSON)


async def test_reasoning_is_free_until_the_marker(engine):
    prompt = prompt_of(engine, "Think first, then answer.")
    free = await complete(engine, prompt, 12, ignore_eos=True)
    # A marker the free output writes as its 4th token, on its own.
    at, marker = next((i, engine.tokenizer.decode([t])) for i, t in enumerate(free.tokens)
                      if i >= 3 and prompt_of(engine, engine.tokenizer.decode([t])) == [t])
    result = await complete(engine, prompt, 60, constraint=lark('start: "yes" | "no"', marker))
    assert result.tokens[:at + 1] == free.tokens[:at + 1]
    answer = engine.tokenizer.decode(result.tokens[at + 1:])
    assert answer in ("yes", "no")
    assert result.finish.reason == "stop"


async def test_logprobs_are_the_models_not_the_masks(engine):
    prompt = prompt_of(engine, "Logprobs, please.")
    free = await complete(engine, prompt, 1, logprobs=5)
    forced = await complete(engine, prompt, 20, logprobs=5, constraint=lark('start: "{}"'))
    # The first constrained step reports the model's own distribution (the same top 5 as
    # without the grammar), while its token is the one the grammar allowed.
    assert forced.events[0].top_logprobs == free.events[0].top_logprobs
    assert forced.text == "{}"
    first = forced.events[0].logprob
    assert first.token == forced.tokens[0] and first.logprob <= free.events[0].logprob.logprob


async def test_an_invalid_grammar_fails_only_its_request(engine, reference):
    prompt = prompt_of(engine, "Fine request.")
    good = asyncio.create_task(complete(engine, prompt, 10))
    with pytest.raises(ConstraintUnmet, match="invalid grammar"):
        await complete(engine, prompt_of(engine, "Bad grammar."), 10,
                       constraint=lark("start: undefined_rule"))
    assert (await good).tokens == reference.greedy(prompt, 10)
    stats = await settled(engine)
    assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)


async def test_cancel_mid_constraint_releases_everything(engine):
    stream = engine.submit(prompt_of(engine, "An endless list."), SamplingParams(
        max_tokens=2000, temperature=0.0, constraint=json_schema({
            "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}})))
    assert (await cancel_after(stream, 3)).reason == "cancelled"
    stats = await settled(engine)
    assert (stats.running, stats.waiting, stats.tree.pinned_bytes, stats.tree.pending) == (
        0, 0, 0, 0)


async def test_a_failed_step_rebuilds_the_constraint(family_model_dir, reference, engine,
                                                     monkeypatch, caplog):
    """A step that fails restarts every row from its tokens; a constrained row's matcher
    is rebuilt over what it had generated and ends exactly as without the failure."""
    constraint = json_schema(PERSON, strict=True)
    prompt = prompt_of(engine, "Describe a user as JSON, again.")
    expected = await complete(engine, prompt, 120, constraint=constraint)
    other = prompt_of(engine, "An unconstrained neighbour.")
    free = reference.greedy(other, 12)
    # The neighbour's 4th token breaks the forward pass of the batch it is fed in.
    fault = next(t for t in free[3:] if t not in prompt + expected.tokens + other
                 and free.index(t) >= 3)
    monkeypatch.setattr("engine.engine.load_model", faulty_loader(fault))
    faulty = start_engine(family_model_dir("llama"), cache_bytes=1 << 30)
    try:
        constrained = asyncio.create_task(complete(faulty, prompt, 120, constraint=constraint))
        with pytest.raises(RequestFailed):
            await complete(faulty, other, 12)
        assert (await constrained).tokens == expected.tokens
        assert "step failed" in caplog.text  # both were in the batch that failed
        stats = await settled(faulty)
        assert (stats.running, stats.tree.pinned_bytes, stats.tree.pending) == (0, 0, 0)
    finally:
        faulty.shutdown()


async def test_a_preempted_row_goes_on_in_its_grammar(family_model_dir, engine):
    """A row preempted when the batch's KV outgrew the limit comes back with its matcher
    rebuilt over what it wrote, and writes what it would have written in the batch."""
    constraint = regex("[a-z]+( [a-z]+)*")
    prompts = [prompt_of(engine, f"Words, list {i}:") for i in range(2)]
    expected = [await complete(engine, p, 50, constraint=constraint, ignore_eos=True)
                for p in prompts]
    tight = start_engine(family_model_dir("llama"), cache_bytes=1 << 30,
                         max_tokens_in_flight=2 * len(prompts[0]) + 60)
    try:
        tight._scheduler.limits.output_reserve = 8
        results = await asyncio.gather(*(complete(tight, p, 50, constraint=constraint,
                                                  ignore_eos=True) for p in prompts))
        assert [r.tokens for r in results] == [e.tokens for e in expected]
        assert all(re.fullmatch("[a-z]+( [a-z]+)*", r.text) for r in results)
        assert (await settled(tight)).counters.requests_preempted >= 1
    finally:
        tight.shutdown()


async def test_real_model_answers_in_the_schema_and_calls_the_forced_tool(real_engine):
    """SmolLM2-135M-Instruct, the default model: a structured answer and a forced call."""
    city = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}},
        "required": ["city", "country"], "additionalProperties": False}
    chat = real_engine.tokenizer.chat_prompt
    answer, call = await asyncio.gather(
        complete(real_engine, chat([{"role": "user", "content":
                                     "What is the capital of France? Answer in JSON."}]),
                 40, constraint=json_schema(city, strict=True)),
        complete(real_engine, chat([{"role": "user", "content": "What's the weather in Paris?"}]),
                 40, constraint=tool_calls([WEATHER, CLOCK], name="get_weather")))
    parsed = json.loads(answer.text)
    jsonschema.validate(parsed, city)
    assert "Paris" in parsed["city"]
    start, end = json_tools.tool_call_start, json_tools.tool_call_end
    arguments = json_tools.parse_tool_call(call.text[len(start):-len(end)])["arguments"]
    jsonschema.validate(arguments, WEATHER.parameters)
    assert "Paris" in arguments["city"]


async def test_real_model_repeats_no_key_of_open_arguments(real_engine):
    """A forced call whose parameters allow more keys, as instructor's do. The model runs
    on in a loop of keys ("gender_role_type", "gender_role_role_type", ...) until
    max_tokens; it wrote "gender_role_role_role_role_type" eight times before keys were
    checked, and now makes that key longer instead. That tenth key passes the point where
    it would have repeated the ninth at 116 tokens: 128 show it."""
    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": True}
    prompt = real_engine.tokenizer.chat_prompt([{"role": "user", "content": (
        "Alice, 30, is an engineer. Describe her in as much detail as you can.")}])
    call = await complete(real_engine, prompt, 128,
                          constraint=tool_calls([FunctionTool("record", person)]))
    arguments = call.text.split('"arguments": ', 1)[1]
    # The keys written whole (the last one may be cut short), each followed by its value.
    keys = re.findall(r'"((?:[^"\\]|\\.)*)": ', arguments)
    assert keys[:3] == ["name", "age", "gender"] and len(keys) >= 9
    assert len(set(keys)) == len(keys), keys


async def test_a_grammar_compiles_while_the_batch_decodes(engine, monkeypatch):
    """A request's grammar is compiled beside the engine's loop, not in it: a schema of
    thousands of properties compiles for seconds, and in the loop every running stream
    stood still meanwhile (past step_timeout for a few such requests, failing them all).
    Here the compile goes on only once a running stream has decoded 8 more tokens."""
    decoded = threading.Event()
    waited: list[bool] = []
    compile_matcher = engine_grammar.LLMatcher

    def compiled_after_decoding(*args, **kwargs):
        waited.append(decoded.wait(30))
        return compile_matcher(*args, **kwargs)

    monkeypatch.setattr(engine_grammar, "LLMatcher", compiled_after_decoding)
    running = engine.submit(prompt_of(engine, "Count on."),
                            SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    stream = aiter(running)
    assert isinstance(await anext(stream), TokenEvent)
    schema = {**PERSON, "description": "compiled beside the loop"}
    constrained = asyncio.create_task(complete(engine, prompt_of(engine, "A user."), 120,
                                               constraint=json_schema(schema, strict=True)))
    seen = 0
    async for event in stream:
        seen += isinstance(event, TokenEvent)
        if seen == 8:
            decoded.set()
            running.cancel()
    result = await constrained
    assert waited == [True]
    jsonschema.validate(json.loads(result.text), PERSON)


async def test_compiled_grammars_are_kept_within_a_budget_of_their_text(engine, monkeypatch):
    """Compiled grammars are kept by count and by the length of their texts together: a
    few schemas of hundreds of kB held gigabytes while the count allowed 64. The newest
    is always kept."""
    monkeypatch.setattr(engine_grammar, "GRAMMAR_CACHE_CHARS", 6000)
    grammars = engine_grammar.Grammars(engine.tokenizer, engine.tokenizer.vocab_size)
    texts = [json_schema({**PERSON, "description": str(n) * 2000}).grammar for n in range(3)]
    for text in texts:
        grammars.compile(text)
    assert [grammars.compiled(text) for text in texts] == [False, True, True]
    grammars.compile(huge := json_schema({**PERSON, "description": "x" * 9000}).grammar)
    assert grammars.compiled(huge) and not any(grammars.compiled(text) for text in texts)


async def test_a_marker_written_in_other_tokens_still_starts_the_grammar(engine):
    """A model may write a plain-text marker in other tokens than its encoding's
    (`<tool` then `_call>`): the text it ends is the marker all the same."""
    grammars = engine_grammar.Grammars(engine.tokenizer, engine.tokenizer.vocab_size)
    constraint = tool_calls([FunctionTool("f", None)], text=True, lazy=True)
    encode = partial(engine.tokenizer.encode, special_tokens=False)
    split = encode("Sure. <tool") + encode("_call>")
    assert split[-len(encode("<tool_call>")):] != encode("<tool_call>")
    state = grammars.state(constraint)
    for token in split[:-1]:
        state.accept(token)
        assert state.matcher is None
    state.accept(split[-1])
    assert state.matcher is not None and state.constraining


async def test_a_marker_cannot_end_inside_a_token(engine):
    """SmolLM2 writes `<tool_call></tool_call>` as `... <tool _ call ></ ...`: the marker
    would end inside `></`, where nothing sees it end. After `<tool_call`, every token in
    which it would end before its last byte is masked; plain text is not."""
    grammars = engine_grammar.Grammars(engine.tokenizer, engine.tokenizer.vocab_size)
    constraint = tool_calls([FunctionTool("f", None)], text=True, lazy=True)
    encode = partial(engine.tokenizer.encode, special_tokens=False)
    state = grammars.state(constraint)
    for token in encode("Sure, I can book it"):
        state.accept(token)
    assert not state.constraining
    for token in encode(" <tool_call"):
        state.accept(token)
    assert state.constraining and not state.matcher
    [mask] = engine_grammar.masks([state], None)
    allowed = {token for token in range(engine.tokenizer.vocab_size)
               if mask[token >> 5] >> (token & 31) & 1}
    [inside] = encode("></")
    assert inside not in allowed and encode(">")[0] in allowed
