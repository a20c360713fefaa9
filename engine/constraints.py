"""The grammars behind structured output and forced tool calls, as `Constraint`s.

The server builds a constraint here and passes it in `SamplingParams.constraint`:

    json_object()                            response_format {"type": "json_object"}
    json_schema(schema, strict)              response_format {"type": "json_schema", ...}
    tool_calls(tools, parallel=p)            tool_choice "required": a call of any tool
    tool_calls(tools, name="f", parallel=p)  tool_choice {"type": "function", ... "f"}
    tool_calls(tools, parallel=p,            tool_choice "auto" beside a response_format:
               answer=JsonAnswer(schema))    calls, or the answer in that format instead

with p = parallel_tool_calls (one or more calls, one after another, or exactly one); and
for text that is not JSON (other servers' grammar fields: vLLM's guided_regex,
guided_choice and guided_grammar, llama.cpp's grammar, SGLang's regex and ebnf):

    regex(pattern)                           the whole text matches the pattern
    choice(options)                          exactly one of the options
    grammar(definition)                      text in a Lark or GBNF grammar

Pass the model format's call markers as `call_format` (default: Hermes/Qwen's
<tool_call>...). The generated text then parses with mlx-lm's `json_tools` parser between
the markers.

Every schema is first rewritten by `engine.json_schemas.for_generation`: required
properties first and, unless `close_objects=False`, objects that list their properties
closed to them (strict or not: OpenAI's strict mode closes every object too).

For a reasoning model, set the end-of-thinking marker on the result
(`dataclasses.replace(constraint, after="</think>")`): the thinking stays free and the
grammar applies to the answer after it.

A schema that cannot be enforced raises `UnsupportedSchema`, whose `keyword` names the
JSON Schema keyword at fault (the server answers 400 with it); `UnsupportedAnswer` when
it is `tool_calls`' answer. `strict` has OpenAI's
meaning: True asks for exact adherence, so a keyword the grammar engine cannot enforce
("not", "if", "uniqueItems", an unknown "format", ...) is refused; False enforces what it
can and ignores such keywords. A malformed schema is refused either way.

JSON is generated in one fixed layout, json.dumps's default (", " and ": " separators, no
newlines): a layout with optional whitespace lets a small model pad its output with
blanks until max_tokens (a known failure of grammar-constrained decoding), and this one is
how models write tool calls in the Hermes/Qwen format ({"name": ..., "arguments": ...}).

No MLX here; the grammars are llguidance's (see engine/grammar.py for the choice).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from engine.api import Constraint
from engine.grammar_check import CHECKER
from engine.json_schemas import for_generation, too_low_maximum

# llguidance's JSON compile options for every schema here; see the module docstring.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class UnsupportedSchema(ValueError):
    """A JSON Schema the engine cannot enforce; `keyword` names the culprit if known."""

    def __init__(self, message: str, keyword: str | None = None) -> None:
        super().__init__(message)
        self.keyword = keyword


class UnsupportedGrammar(ValueError):
    """A regular expression or grammar the engine cannot compile, or that admits no text."""


class UnsupportedAnswer(UnsupportedSchema):
    """The schema `tool_calls` refused was its `answer`'s (the request's output format),
    not a function's parameters."""


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call: OpenAI's `tools[].function` (name, parameters,
    strict). `parameters` None means the function takes no arguments."""

    name: str
    parameters: Mapping[str, Any] | None = None
    strict: bool = False


@dataclass(frozen=True)
class ToolCallFormat:
    """How the model's format writes a call: `start` + {"name": ..., "arguments": {...}}
    + `end`, and `separator` between parallel calls. The default is Hermes/Qwen's, which
    mlx-lm's `json_tools` parser reads (it strips the whitespace around the JSON)."""

    start: str = "<tool_call>\n"
    end: str = "\n</tool_call>"
    separator: str = "\n"


HERMES = ToolCallFormat()


@dataclass(frozen=True)
class JsonAnswer:
    """The answer a reply may give instead of tool calls: JSON valid against `schema`
    (`strict` as for `json_schema`)."""

    schema: Mapping[str, Any]
    strict: bool = False


ANY_JSON_OBJECT = JsonAnswer({"type": "object"}, strict=True)


def json_object() -> Constraint:
    """Any JSON object."""
    return json_schema(ANY_JSON_OBJECT.schema, strict=ANY_JSON_OBJECT.strict)


def json_schema(schema: Mapping[str, Any], strict: bool = False, close_objects: bool = True
                ) -> Constraint:
    """JSON that validates against `schema`."""
    grammar = _grammar_from_schema(schema, strict, close_objects)
    _validate(grammar)
    return Constraint(grammar, bounded_keys=_keys_by_pattern(schema))


def tool_calls(tools: Sequence[FunctionTool], name: str | None = None, parallel: bool = False,
               call_format: ToolCallFormat = HERMES, answer: JsonAnswer | None = None,
               text: bool = False, close_objects: bool = True, lazy: bool = False
               ) -> Constraint:
    """One call (one or more in a row if `parallel`) of the function `name`, or of any of
    `tools` when `name` is None, whose arguments validate against its parameters; or,
    when `answer` is given, that JSON answer instead of any call; or, with `text`, any
    text that may end in such calls: the one thing it cannot hold is a call's start
    marker that no allowed call follows.

    `lazy` (with `text`) says the same with a grammar that waits for the start marker
    (`Constraint.after`): the text before it is the model's own, unmasked, as llama.cpp's
    lazy grammars leave it. Masking every token of a reply that calls nothing cost a batch
    of 16 such replies 9-14% of its rate on an H200 (the host's work for each masked row);
    the grammar cannot wait for a marker after another (a reasoning model's end of
    thinking), so those take `text`. While it waits, a plain-text marker is kept from
    ending inside a token (`grammar.MarkerGuard`), where it would not be seen."""
    if name is not None:
        tools = [tool for tool in tools if tool.name == name]
        if not tools:
            raise ValueError(f"no function named {name!r} among the tools")
    if not tools:
        raise ValueError("tool calls need at least one function")
    more = f" ({_literal(call_format.separator)} call)*" if parallel else ""
    rules = ["start: calls" if answer is None else "start: calls | answer",
             f"calls: call{more}",
             f"call: {_literal(call_format.start)} body {_literal(call_format.end)}",
             "body: " + " | ".join(f"tool_{i}" for i in range(len(tools)))]
    after = None  # the marker the grammar waits for
    if text:
        marker = call_format.start.rstrip()
        rules.append(f"called: {_literal(call_format.start[len(marker):])} body "
                     f"{_literal(call_format.end)}{more}")
        if lazy:
            rules[0] = "start: called"
            after = marker
        else:
            # Free text is one greedy lexeme, which would swallow a call's marker, so what
            # leads up to a call is a lexeme of its own that ends at the marker (a `stop`).
            rules[0] = "start: TEXT | lead called"
            pattern = re.escape(marker).replace("/", "\\/")
            rules += [f"TEXT: /(?s:.*)/ & ~/(?s:.*){pattern}(?s:.*)/",
                      f"lead[stop={_literal(marker)}]: /(?s:.*)/"]
    if answer is not None:
        try:
            rules.append(_json_rule("answer", answer.schema, answer.strict, close_objects))
        except (TypeError, ValueError) as error:
            raise UnsupportedAnswer(str(error), getattr(error, "keyword", None)) from None
    for i, tool in enumerate(tools):
        parameters = tool.parameters if tool.parameters is not None else {
            "type": "object", "properties": {}, "additionalProperties": False}
        head = '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
        rules.append(f"tool_{i}: {_literal(head)} arguments_{i} {_literal('}')}")
        try:
            rules.append(_json_rule(f"arguments_{i}", parameters, tool.strict, close_objects))
        except UnsupportedSchema as error:
            raise UnsupportedSchema(f"function {tool.name!r}: {error}", error.keyword) from None
    grammar = LLMatcher.grammar_from_lark("\n".join(rules))
    _validate(grammar)
    schemas = [tool.parameters for tool in tools] + [answer.schema if answer else None]
    return Constraint(grammar, after=after, bounded_keys=_keys_by_pattern(schemas))


def regex(pattern: str) -> Constraint:
    """Text the whole of which matches `pattern`, in the Rust regex syntax llguidance reads
    (Python's, less lookaround and backreferences)."""
    return _plain_text(LLMatcher.grammar_from_regex(pattern))


def choice(options: Sequence[str]) -> Constraint:
    """Exactly one of `options`, as written."""
    return _plain_text(LLMatcher.grammar_from_lark(
        "start: " + " | ".join(_literal(option) for option in options)))


def grammar(definition: str) -> Constraint:
    """Text in a context-free grammar: Lark, as llguidance writes it, or GBNF, llama.cpp's,
    which is turned into Lark first (each is told from the other by its syntax)."""
    try:
        lark = any_to_lark(definition)
    except Exception as error:  # noqa: BLE001 - the converter raises its own and others
        raise UnsupportedGrammar(f"not a Lark or GBNF grammar: {error}") from None
    return _plain_text(LLMatcher.grammar_from_lark(lark))


def _plain_text(compiled: str) -> Constraint:
    try:
        _validate(compiled)
    except UnsupportedSchema as error:
        raise UnsupportedGrammar(str(error)) from None
    return Constraint(compiled, json_text=False)


def _keys_by_pattern(schema: Any) -> bool:
    """Whether a `patternProperties` appears anywhere in `schema` (a JSON document)."""
    if isinstance(schema, Mapping):
        return bool(schema.get("patternProperties")) or any(
            _keys_by_pattern(value) for value in schema.values())
    if isinstance(schema, list):
        return any(_keys_by_pattern(item) for item in schema)
    return False


def _json_rule(rule: str, schema: Mapping[str, Any], strict: bool, close_objects: bool) -> str:
    """A Lark rule for JSON valid against `schema`, refused as `json_schema` refuses it.
    The schema is a JSON document of its own in the rule, so its "$ref"s resolve
    against it as they would for any validator."""
    _validate(_grammar_from_schema(schema, strict, close_objects))
    laid_out = _with_layout(schema, strict, close_objects)
    return f"{rule}: %json {json.dumps(laid_out, ensure_ascii=False)}"


def _with_layout(schema: Mapping[str, Any], strict: bool, close_objects: bool
                 ) -> dict[str, Any]:
    if not isinstance(schema, Mapping):
        raise UnsupportedSchema("a JSON Schema must be an object")
    options = {**(schema.get("x-guidance") or {}), **JSON_LAYOUT, "lenient": not strict}
    return {**for_generation(schema, close_objects), "x-guidance": options}


def _grammar_from_schema(schema: Mapping[str, Any], strict: bool, close_objects: bool) -> str:
    if found := too_low_maximum(schema):
        keyword, value = found
        raise UnsupportedSchema(f"{keyword} {value} is at or past the smallest 64-bit integer",
                                keyword)
    try:
        return LLMatcher.grammar_from_json_schema(
            json.dumps(_with_layout(schema, strict, close_objects), ensure_ascii=False))
    except (TypeError, ValueError) as error:
        raise UnsupportedSchema(f"invalid JSON Schema: {error}") from None


def _validate(grammar: str) -> None:
    """Refuse a grammar llguidance rejects (or dies on: checked in a process of its own,
    engine/grammar_check.py), or one that admits no first byte: whatever the model's
    vocabulary, no output could start (a schema that is only a `$ref` to itself). A
    schema that runs dry further in is found as the model writes it
    (`engine.grammar.ConstraintFailed`)."""
    verdict = CHECKER.check(grammar)
    if verdict.error is not None:
        raise UnsupportedSchema(verdict.error, _keyword_in(verdict.error))
    if not verdict.can_start:
        raise UnsupportedSchema("no value satisfies it")


def _length_bound(match: re.Match[str]) -> str:
    """Which of a string's length bounds, compiled to a regex repetition {min,max}, is out
    of the regex engine's range: the larger."""
    least, most = match.group(1), match.group(2)
    return "maxLength" if most and int(most) > int(least or 0) else "minLength"


# How llguidance names the keyword at fault in its errors. Some keywords it compiles into
# regular expressions first, and their errors read as the regex's: matched before a
# `pattern`'s.
_KEYWORD_PATTERNS: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    (re.compile(r'Unimplemented keys: \["([^"]+)"'), lambda match: match.group(1)),
    (re.compile(r"Unknown format"), "format"),
    (re.compile(r"Invalid type"), "type"),
    (re.compile(r"oneOf"), "oneOf"),
    (re.compile(r"\$ref|\breference|Pointer", re.IGNORECASE), "$ref"),
    (re.compile(r"\(\?s:\.\{(\d*),(\d*)\}\)"), _length_bound),
    (re.compile(r"(?:integer|float) range: min=Some"), "minimum"),
    (re.compile(r"(?:integer|float) range"), "maximum"),
    (re.compile(r"pattern|regex", re.IGNORECASE), "pattern"),
)


def _keyword_in(message: str) -> str | None:
    for pattern, keyword in _KEYWORD_PATTERNS:
        if match := pattern.search(message):
            return keyword if isinstance(keyword, str) else keyword(match)
    return None


def _literal(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)
