"""No JSON output repeats a key: the grammar's masks with repeating keys taken out, on
llguidance's byte tokenizer (one token per byte) and on a vocabulary of longer tokens."""

from __future__ import annotations

import importlib
import pkgutil

import mlx_lm.tool_parsers
import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer

from engine.api import Constraint
from engine.constraints import FunctionTool, ToolCallFormat, json_object, json_schema, tool_calls
from engine.grammar import GrammarState, masks
from engine.json_keys import JsonKeys, KeyTokens

BYTES = LLTokenizer("byte")
BYTE_TOKENS = KeyTokens([b"" if BYTES.is_special_token(token) else BYTES.decode_bytes([token])
                             for token in range(BYTES.vocab_size)])
OPEN = {"type": "object", "additionalProperties": True}


def state_after(constraint: Constraint, text: str) -> tuple[GrammarState, np.ndarray]:
    """The state of a sequence that wrote `text` under `constraint`, and its next mask."""
    matcher = LLMatcher(BYTES, constraint.grammar, log_level=0)
    state = GrammarState(matcher, (), words=(BYTES.vocab_size + 31) // 32,
                         key_tokens=BYTE_TOKENS, look_ahead=constraint.bounded_keys)
    for token in BYTES.tokenize_str(text):
        state.accept(token)
    assert state.error is None, state.error
    return state, masks([state], None)[0]


def allows(constraint: Constraint, text: str, then: str) -> bool:
    """May the byte `then` follow `text`?"""
    _, mask = state_after(constraint, text)
    return bool(mask.view(np.uint32)[ord(then) >> 5] >> (ord(then) & 31) & 1)


def test_an_open_object_cannot_repeat_a_key():
    constraint = json_schema(OPEN)
    assert allows(constraint, '{"ab": 1, "a', '"')
    assert allows(constraint, '{"ab": 1, "ab', "c")
    assert not allows(constraint, '{"ab": 1, "ab', '"')
    assert not allows(json_object(), '{"x": {}, "y": [], "x', '"')


def test_keys_compare_as_the_strings_they_stand_for():
    constraint = json_schema(OPEN)
    assert not allows(constraint, '{"a\\nb": 1, "a\\u000ab', '"')
    assert not allows(constraint, '{"a\\"b": 1, "a\\"b', '"')
    assert allows(constraint, '{"a\\\\": 1, "a\\', '"')  # the quote is escaped: not an end
    assert not allows(constraint, '{"a\\\\": 1, "a\\\\', '"')


def test_each_object_has_keys_of_its_own():
    constraint = json_object()
    assert allows(constraint, '{"a": {"a', '"')
    assert allows(constraint, '{"a": {"b": 1}, "b', '"')
    assert allows(constraint, '{"a": [{"x": 1}, {"x', '"')
    assert not allows(constraint, '{"a": [{"x": 1}], "b": {}, "a', '"')
    assert allows(constraint, '{"a": "b", "c": "b', '"')  # values are not keys


def test_listed_properties_are_unique_beside_open_ones():
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "additionalProperties": {"type": "integer"}}
    constraint = json_schema(schema)
    assert not allows(constraint, '{"name": "x", "n": 1, "n', '"')
    assert not allows(constraint, '{"name": "x", "name', '"')


@pytest.mark.parametrize("call_format", [
    ToolCallFormat(),  # Hermes/Qwen: <tool_call>\n ... \n</tool_call>
    ToolCallFormat("[TOOL_CALLS]", "", ""),  # Mistral's markers hold brackets
])
def test_tool_call_arguments_cannot_repeat_a_key(call_format):
    tool = FunctionTool("f", OPEN)
    constraint = tool_calls([tool], parallel=True, call_format=call_format)
    call = call_format.start + '{"name": "f", "arguments": {"x": 1'
    assert not allows(constraint, call + ', "x', '"')
    # The next call's arguments are an object of their own.
    second = call + "}}" + call_format.end + call_format.separator + call_format.start
    assert allows(constraint, second + '{"name": "f", "arguments": {"x', '"')


def test_the_markers_of_every_format_mlx_lm_knows_read_as_no_key():
    """What engine/json_keys.py relies on: no quote, brackets balanced."""
    for module in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__):
        parser = importlib.import_module(f"mlx_lm.tool_parsers.{module.name}")
        for marker in (parser.tool_call_start, parser.tool_call_end):
            assert '"' not in marker, (module.name, marker)
            depth = 0
            for char in marker:
                depth += (char in "{[") - (char in "}]")
                assert depth >= 0, (module.name, marker)
            assert depth == 0, (module.name, marker)


def test_an_object_whose_keys_are_all_written_fails_instead_of_repeating_one():
    only_a = {"type": "object", "patternProperties": {"^a$": {"type": "integer"}},
              "additionalProperties": False}
    state, mask = state_after(json_schema(only_a), '{"a": 1, "a')
    assert "repeats a key" in state.error
    assert (mask == -1).all()  # the row fails at this token; its sampling stays finite


def test_tokens_of_several_bytes_close_keys_as_a_whole():
    vocab = [b'{"', b'a', b'a"', b'"', b'": 1', b', "', b'ab"', b'\\u0061"', b'b": 2}', b'a":']
    tokens = KeyTokens(vocab)
    keys = JsonKeys()
    for token in (b'{"', b'a', b'": 1', b', "'):
        keys.feed(token)
    assert sorted(vocab[t] for t in keys.repeating(tokens)) == [b'\\u0061"', b'a"', b'a":']
    keys.feed(b"a")
    assert sorted(vocab[t] for t in keys.repeating(tokens)) == [b'"', b'": 1']


def test_a_key_is_not_written_into_a_corner_where_it_can_only_repeat_one():
    a_or_b = {"type": "object", "patternProperties": {"^(a|b)$": {"type": "integer"}},
              "additionalProperties": False}
    assert not allows(json_schema(a_or_b), '{"b": 0, "', "b")  # then only `"` would follow
    assert allows(json_schema(a_or_b), '{"b": 0, "', "a")
    long_names = {"type": "object", "additionalProperties": False,
                  "patternProperties": {"^(abc|abd|x)$": {"type": "integer"}}}
    assert allows(json_schema(long_names), '{"abc": 0, "', "a")  # on to "abd"
    assert not allows(json_schema(long_names), '{"abc": 0, "abd": 1, "', "a")
    assert allows(json_schema(long_names), '{"abc": 0, "abd": 1, "', "x")
    assert allows(json_schema(OPEN), '{"a": 0, "', "a")  # "ab", "a2", ... are other keys



def test_an_object_whose_keys_are_all_written_ends_instead_of_taking_a_comma():
    a_or_b = {"type": "object", "patternProperties": {"^(a|b)$": {"type": "integer"}},
              "additionalProperties": False}
    assert not allows(json_schema(a_or_b), '{"a": 0, "b": 1', ",")
    assert allows(json_schema(a_or_b), '{"a": 0, "b": 1', "}")
    assert allows(json_schema(a_or_b), '{"a": 0', ",")
    assert allows(json_schema(OPEN), '{"a": 0, "b": 1', ",")


def test_only_grammars_whose_keys_can_run_out_are_looked_ahead():
    by_pattern = {"type": "object", "additionalProperties": False,
                  "properties": {"inner": {"patternProperties": {"^x$": {}}}}}
    assert json_schema(by_pattern).bounded_keys
    assert tool_calls([FunctionTool("f", by_pattern)]).bounded_keys
    assert not json_schema(OPEN).bounded_keys and not json_object().bounded_keys
    assert not tool_calls([FunctionTool("f", OPEN)]).bounded_keys
