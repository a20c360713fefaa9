"""The constraint builders the server calls: what they refuse, and what they name."""

from __future__ import annotations

import dataclasses
import json
import threading
import tracemalloc

import pytest
from llguidance import LLMatcher, LLTokenizer
from pydantic import BaseModel

from engine.api import Constraint
from engine.constraints import (
    FunctionTool,
    ToolCallFormat,
    UnsupportedGrammar,
    UnsupportedSchema,
    choice,
    grammar,
    json_object,
    json_schema,
    regex,
    tool_calls,
)
from engine.grammar_check import GRAMMAR_THREAD_STACK_BYTES, GrammarChecker, Verdict
from engine.json_schemas import strict_mode

WEATHER = FunctionTool("get_weather", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "no-such-format"}, "format"),
    ({"type": "strng"}, "type"),
    ({"$ref": "#/$defs/missing"}, "$ref"),
    ({"type": "string", "pattern": "(("}, "pattern"),
    # The regex engine's "backreferences are not supported" is no `$ref`'s.
    ({"type": "string", "pattern": "^(a)\\1$"}, "pattern"),
    # Bounds compiled into regular expressions, past the regex engine's range.
    ({"type": "string", "maxLength": 10**12}, "maxLength"),
    ({"type": "string", "minLength": 3, "maxLength": 10**12}, "maxLength"),
    ({"type": "string", "minLength": 10**12}, "minLength"),
    ({"type": "integer", "minimum": -1e30}, "minimum"),
    ({"type": "number", "minimum": -1e300}, "minimum"),
])
def test_strict_schema_the_engine_cannot_enforce_is_refused_naming_the_keyword(schema, keyword):
    with pytest.raises(UnsupportedSchema) as refused:
        json_schema(schema, strict=True)
    assert refused.value.keyword == keyword


def test_non_strict_schema_ignores_keywords_it_cannot_enforce():
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    assert json_schema(schema, strict=False).grammar


def test_malformed_schema_is_refused_even_when_not_strict():
    with pytest.raises(UnsupportedSchema):
        json_schema({"type": "strng"}, strict=False)
    with pytest.raises(UnsupportedSchema):
        json_schema(["not", "a", "schema"], strict=False)  # type: ignore[arg-type]


def test_a_schema_no_output_can_start_is_refused():
    """A schema that is only a `$ref` to itself compiles, but no byte can begin a value:
    the request would fail at its first token."""
    with pytest.raises(UnsupportedSchema, match="no value satisfies it"):
        json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})


def test_a_schema_that_forces_an_output_without_end_is_refused():
    """A required property whose value is its own object type: every value starts
    `{"n": {"n": ...` and none ends. The model's grammar failed at its creation, inside a
    stream already begun; a 100 kB constant, forced too, ends and is enforced."""
    endless = {"$ref": "#/$defs/a", "$defs": {"a": {
        "type": "object", "properties": {"n": {"$ref": "#/$defs/a"}}, "required": ["n"]}}}
    with pytest.raises(UnsupportedSchema, match="the output it forces from the start .* exceeds"):
        json_schema(endless)
    assert json_schema({"const": "x" * 100_000}).grammar


@pytest.mark.parametrize("integer", [
    {"type": "integer", "minimum": -1e19, "maximum": -1e19},
    {"type": ["integer", "null"], "minimum": -(2**63), "maximum": -(2**63) + 1},
    {"type": "integer", "exclusiveMaximum": -(2**63) + 1, "minimum": -1e19},
])
def test_an_integer_at_the_edge_of_64_bits_is_refused_not_compiled(integer):
    """llguidance 1.9 dies (SIGSEGV, the whole server with it) compiling an integer whose
    maximum lies at the smallest 64-bit integer: such a schema is refused before it is
    compiled, wherever it sits in the schema. Were it compiled, this test's process would
    be the one to die."""
    for schema in (integer, {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}},
                             "$defs": {"n": integer}},
                   {"anyOf": [{"type": "string"}, {"items": [integer]}]}):
        with pytest.raises(UnsupportedSchema, match="smallest 64-bit integer") as refused:
            json_schema(schema)
        assert refused.value.keyword in ("maximum", "exclusiveMaximum")
    with pytest.raises(UnsupportedSchema, match="smallest 64-bit integer"):
        tool_calls([FunctionTool("f", {"type": "object", "properties": {"n": integer}})])
    assert json_schema({"type": "integer", "minimum": -10**18, "maximum": -5}).grammar


def test_a_grammar_that_kills_the_grammar_engine_costs_its_check_only():
    """Grammars compile first in a process of their own: one that kills llguidance (the
    crash the check above now refuses earlier, sent as a grammar) is an error verdict,
    remembered, and the next grammar gets a new process."""
    checker = GrammarChecker()
    deadly = LLMatcher.grammar_from_json_schema(
        json.dumps({"type": "integer", "minimum": -1e19, "maximum": -1e19}))
    assert checker.check(json_object().grammar) == Verdict(None)
    for _ in range(2):
        assert checker.check(deadly).error == "the grammar crashed the grammar engine"
    assert checker.check(LLMatcher.grammar_from_json_schema('{"type": "string"}')) == \
        Verdict(None)


def test_remembered_verdicts_hold_no_grammar_text():
    """A verdict is remembered by its grammar's digest: a schema's text can be megabytes
    (a long description), and 512 remembered by their text held 2 GB of a server."""
    def described(i: int) -> str:  # a schema of 1 MiB, gone once checked
        return LLMatcher.grammar_from_json_schema(json.dumps(
            {"type": "string", "description": f"{i} " + "x" * 2**20}))

    checker = GrammarChecker()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        assert [checker.check(described(i)) for i in range(4)] == [Verdict(None)] * 4
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2**20, f"{held} bytes held after checking 4 MiB of grammars"


def rule_chain(rules: int) -> str:
    """A lark grammar of `rules` rules, each naming the next: llguidance recurses once
    per rule as it compiles it."""
    return LLMatcher.grammar_from_lark("start: r0\n" + "".join(
        f'r{i}: "a" r{i + 1}\n' for i in range(rules)) + f'r{rules}: "b"\n')


def test_a_grammar_deeper_than_the_check_s_stack_is_refused_with_room_to_spare():
    """The check compiles on a quarter of the stack the engine's grammar threads get: a
    chain of 2,000 rules, which an engine thread compiles, is refused by the check (it
    overflows the checker's stack, not the server's), and one of 1,000 passes."""
    checker = GrammarChecker()
    assert checker.check(rule_chain(1000)) == Verdict(None)
    assert checker.check(rule_chain(2000)).error == "the grammar crashed the grammar engine"

    compiled: list[bool] = []
    threading.stack_size(GRAMMAR_THREAD_STACK_BYTES)
    try:
        engine_thread = threading.Thread(target=lambda: compiled.append(
            not LLMatcher(LLTokenizer("byte"), rule_chain(2000), log_level=0).is_error()))
        engine_thread.start()
        engine_thread.join()
    finally:
        threading.stack_size(0)
    assert compiled == [True]


def test_equal_schemas_give_equal_constraints():
    """The engine caches compiled grammars by the constraint's grammar text."""
    assert json_object() == json_object()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert json_schema(schema) == json_schema(dict(schema))


def test_tool_calls_name_the_function_whose_parameters_are_refused():
    bad = FunctionTool("dedupe", {"type": "object", "properties": {
        "ids": {"type": "array", "uniqueItems": True}}}, strict=True)
    with pytest.raises(UnsupportedSchema, match="dedupe") as refused:
        tool_calls([WEATHER, bad])
    assert refused.value.keyword == "uniqueItems"


def test_a_named_function_must_be_among_the_tools():
    with pytest.raises(ValueError, match="no function named 'missing'"):
        tool_calls([WEATHER], name="missing")
    with pytest.raises(ValueError):
        tool_calls([])


def test_reasoning_marker_is_set_on_the_built_constraint():
    constraint = dataclasses.replace(json_object(), after="</think>")
    assert constraint.after == "</think>" and constraint.grammar == json_object().grammar


def test_a_lazy_call_grammar_starts_after_the_marker_and_binds_the_call():
    """The text before a call is the model's own, unmasked: the grammar waits for the
    call's marker, then admits only calls of the tools, and ends with them."""
    constraint = tool_calls([WEATHER], parallel=True, text=True, lazy=True)
    assert constraint.after == "<tool_call>"
    call = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(constraint, call) and accepts(constraint, call + "\n<tool_call>" + call)
    assert not accepts(constraint, call.replace("get_weather", "rm_rf"))
    assert not accepts(constraint, call + " Done.")
    single = tool_calls([WEATHER], parallel=False, text=True, lazy=True)
    assert accepts(single, call) and not accepts(single, call + "\n<tool_call>" + call)


BYTES = LLTokenizer("byte")


def accepts(constraint: Constraint, text: str) -> bool:
    """Does the constraint's grammar accept exactly `text` (one token per byte)?"""
    matcher = LLMatcher(BYTES, constraint.grammar, log_level=0)
    return matcher.consume_tokens(BYTES.tokenize_str(text)) and matcher.is_accepting()


class Person(BaseModel):
    """pydantic's default schema: properties listed, additionalProperties not said."""

    role: str = "staff"
    name: str
    age: int


def test_an_object_that_lists_its_properties_is_closed_to_them():
    constraint = json_schema(Person.model_json_schema())
    assert accepts(constraint, '{"name": "Alice", "age": 30}')
    assert accepts(constraint, '{"name": "Alice", "age": 30, "role": "engineer"}')
    assert not accepts(constraint, '{"name": "Alice", "age": 30, "title": "x"}')
    assert not accepts(constraint, '{"name": "Alice", "age": 30, "age": 31}')


def test_required_properties_come_first():
    constraint = json_schema(Person.model_json_schema())
    assert not accepts(constraint, '{"role": "engineer", "name": "Alice", "age": 30}')


def test_nested_and_referenced_objects_are_closed_too():
    class Team(BaseModel):
        lead: Person
        members: list[Person]

    constraint = json_schema(Team.model_json_schema())
    alice = '{"name": "Alice", "age": 30}'
    assert accepts(constraint, f'{{"lead": {alice}, "members": [{alice}]}}')
    assert not accepts(constraint, f'{{"lead": {alice[:-1]}, "x": 1}}, "members": []}}')
    assert not accepts(constraint, f'{{"lead": {alice}, "members": [{alice[:-1]}, "x": 1}}]}}')


def test_a_forced_calls_arguments_are_closed():
    tool = FunctionTool("add_person", Person.model_json_schema())
    call = '<tool_call>\n{"name": "add_person", "arguments": {"name": "A", "age": 3%s}}' \
        '\n</tool_call>'
    assert accepts(tool_calls([tool], name="add_person"), call % "")
    assert not accepts(tool_calls([tool], name="add_person"), call % ', "x": 1')
    assert accepts(tool_calls([tool], name="add_person", close_objects=False), call % ', "x": 1')


def test_strict_mode_requires_every_listed_property_at_every_depth():
    """OpenAI's Responses API normalizes a function's parameters so (`strict` unsaid):
    an optional property must be written, a `$defs` object's too."""
    class Team(BaseModel):
        lead: Person
        name: str | None = None

    schema = strict_mode(Team.model_json_schema())
    assert schema["required"] == ["lead", "name"]
    assert schema["$defs"]["Person"]["required"] == ["role", "name", "age"]
    constraint = json_schema(schema)
    whole = '{"role": "engineer", "name": "Alice", "age": 30}'
    assert accepts(constraint, f'{{"lead": {whole}, "name": null}}')
    assert not accepts(constraint, f'{{"lead": {whole}}}')
    assert not accepts(constraint, '{"lead": {"name": "Alice", "age": 30}, "name": null}')
    assert Team.model_json_schema()["required"] == ["lead"]  # the input is not changed


def test_objects_that_say_additional_properties_keep_their_word():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "additionalProperties": True}
    assert accepts(json_schema(schema), '{"a": 1, "b": 2}')
    # Listed properties never repeat, not even as extra keys.
    assert not accepts(json_schema(schema), '{"a": 1, "a": 2}')
    typed = {**schema, "additionalProperties": {"type": "string"}}
    assert accepts(json_schema(typed), '{"a": 1, "b": "x"}')
    assert not accepts(json_schema(typed), '{"a": 1, "b": 2}')


def test_without_closing_an_object_is_open_as_json_schema_reads_it():
    constraint = json_schema(Person.model_json_schema(), close_objects=False)
    assert accepts(constraint, '{"name": "Alice", "age": 30, "title": "x"}')


def test_an_object_whose_keys_other_schemas_decide_stays_open():
    """Closing a part of an allOf would refuse the other part's keys."""
    schema = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    assert accepts(json_schema(schema), '{"a": 1, "b": 2}')
    unlisted = {"type": "object", "properties": {"a": {"type": "integer"}},
                "required": ["a", "b"]}
    assert accepts(json_schema(unlisted), '{"a": 1, "b": 2}')


def test_the_schema_given_is_not_changed():
    schema = Person.model_json_schema()
    before = json.dumps(schema)
    json_schema(schema)
    assert json.dumps(schema) == before


def test_text_or_allowed_calls_admits_text_and_text_ending_in_allowed_calls_only():
    """tool_choice allowed_tools, mode "auto": the model may answer, or call one of the
    allowed tools, after some text or straight away; a call of any other tool cannot
    start, not even after text."""
    weather = FunctionTool("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]})
    constraint = tool_calls([weather], parallel=True, text=True)
    call = '<tool_call>\n{"name": "%s", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(constraint, "It is sunny, and a < b in <tool> tags.")
    assert accepts(constraint, "")
    assert accepts(constraint, call % "get_weather")
    assert accepts(constraint, "Let me look.\n" + call % "get_weather")
    assert accepts(constraint, call % "get_weather" + "\n" + call % "get_weather")
    assert not accepts(constraint, call % "delete_everything")
    assert not accepts(constraint, "Let me look.\n" + call % "delete_everything")
    assert not accepts(constraint, call % "get_weather" + " and then some text")
    assert not accepts(tool_calls([weather], text=True),
                       call % "get_weather" + "\n" + call % "get_weather")


def test_text_or_calls_escapes_a_marker_with_regex_characters():
    tool = FunctionTool("f", None)
    bracket = ToolCallFormat("[TOOL_CALLS]|/x\n", "\n[/TOOL_CALLS]", "\n")
    constraint = tool_calls([tool], call_format=bracket, text=True)
    assert accepts(constraint, "text with [TOOL_CALLS] but not the whole marker")
    assert accepts(constraint, 'so: [TOOL_CALLS]|/x\n{"name": "f", "arguments": {}}\n[/TOOL_CALLS]')
    assert not accepts(constraint, 'so: [TOOL_CALLS]|/x\n{"name": "g", "arguments": {}}')


def test_grammars_of_plain_text_are_not_read_as_json() -> None:
    """Other servers' grammar fields: a regex, choices, Lark or GBNF (turned into Lark)."""
    for constraint in (regex("[0-9]{3}"), choice(["yes", "no"]), grammar('start: "a" | "b"'),
                       grammar('root ::= "a" | "b"')):
        assert constraint.json_text is False and constraint.after is None
    assert json_object().json_text is True


@pytest.mark.parametrize(("build", "source", "says"), [
    (regex, "[0-9", "unclosed character class"),
    (regex, "(a)\\1", "backreferences"),
    (regex, "[^\\s\\S]", "no value satisfies it"),
    (grammar, "root ::= (((", "not a Lark or GBNF grammar"),
    (grammar, "start: A\nA: /a/ & /b/", "no value satisfies it"),
])
def test_a_grammar_of_plain_text_that_cannot_be_enforced_is_refused(build, source, says) -> None:
    with pytest.raises(UnsupportedGrammar, match=says):
        build(source)
