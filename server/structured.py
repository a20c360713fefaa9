"""The grammar a request's output must follow: forced tool calls and structured output.

- tool_choice "required" or a named function (with tools offered): the reply is one or
  more calls (exactly one when parallel_tool_calls is false) whose arguments validate
  against the function's parameters, written in the request's tool-call format.
- tool_choice `allowed_tools`: "required" as above, of the allowed tools; "auto" free
  text, which may end in such calls (of the allowed tools only).
- tool_choice "auto" with a tool marked `strict`: free text, which may end in such calls.
  In both, the grammar starts at a call's marker: the text before it is unmasked.
- tools offered with tool_choice "auto" and a `json_object` / `json_schema` output format
  (what the OpenAI Agents SDK sends for an agent with tools and an `output_type`): the
  reply is such calls, or the answer in that format.
- otherwise a `json_object` / `json_schema` output format: the reply is that JSON.
- a grammar of another server's field (a regular expression, choices, a Lark or GBNF
  grammar): the reply is text in it. Never beside tools a call may be made of: its text
  is no JSON a call's grammar could hold as an answer.

Stop sequences and stop token ids end free text only: a constrained reply ends where its
grammar ends, so they are not applied to it (a stop string inside a JSON string, or a
stop token id the grammar allows, would cut it invalid);
allowed tools' "auto" reply is free text, and keeps them as plain "auto" does.
For a reasoning model the grammar starts after the end-of-thinking marker.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from engine import constraints
from engine.api import Constraint
from engine.tokenizer import ToolCallFormat
from server.http.errors import APIError
from server.request import (
    AllowedTools,
    GenerationRequest,
    GrammarOutput,
    JsonObjectOutput,
    JsonSchemaOutput,
    NamedFunction,
    OutputFormat,
    TextOutput,
)


def forces_call(request: GenerationRequest) -> bool:
    choice = request.tool_choice
    return bool(request.offered_tools) and (
        choice == "required" or isinstance(choice, NamedFunction)
        or isinstance(choice, AllowedTools) and choice.mode == "required"
    )


def forced_function(request: GenerationRequest) -> str | None:
    """The function a call must be of, known before the model writes its name: the one
    tool_choice names, or the only tool offered where a call is forced."""
    choice = request.tool_choice
    if isinstance(choice, NamedFunction):
        return choice.name
    if forces_call(request) and len(request.offered_tools) == 1:
        return request.offered_tools[0].name
    return None


def enforces_strict_tools(request: GenerationRequest) -> bool:
    """Plain "auto" offering a bound tool: OpenAI's `strict: true` (and the Responses API's
    default) binds a call's arguments to the tool's schema whatever the tool choice, so the
    reply is free text that may end in calls the grammar writes, as allowed tools' "auto"
    reply is."""
    return (request.tool_choice == "auto" and isinstance(request.output, TextOutput)
            and any(tool.bound for tool in request.offered_tools))


def constrained(request: GenerationRequest) -> bool:
    """Does any grammar apply to this request (`output_constraint` is not None)?"""
    return not isinstance(request.output, TextOutput) or writes_calls(request)


def free_text(request: GenerationRequest) -> bool:
    """Is the reply free text (stop sequences end it) though a grammar applies: allowed
    tools' or strict tools' "auto", whose calls the grammar only restricts, as plain
    "auto" replies'."""
    choice = request.tool_choice
    return enforces_strict_tools(request) or (
        isinstance(choice, AllowedTools) and choice.mode == "auto"
        and isinstance(request.output, TextOutput))


def writes_calls(request: GenerationRequest) -> bool:
    """Does the grammar write this request's tool calls (as JSON between the format's
    markers), rather than the model on its own?"""
    return forces_call(request) or enforces_strict_tools(request) or bool(
        request.offered_tools) and (not isinstance(request.output, TextOutput)
                                    or isinstance(request.tool_choice, AllowedTools))


def constraint_param(request: GenerationRequest) -> str | None:
    """The request's field whose grammar binds the reply (None: free text): the tools'
    where the grammar writes calls, else the output format's."""
    output = request.output
    if writes_calls(request) and (forces_call(request) or isinstance(output, TextOutput)):
        return "tools"
    return None if isinstance(output, TextOutput) else _format_param(output)


def _format_param(output: OutputFormat) -> str:
    """The field an output format came in: OpenAI's response_format (the Responses API's
    text.format, as its errors name it), or another server's grammar field."""
    if isinstance(output, JsonSchemaOutput | GrammarOutput):
        return output.param
    return "response_format"


def output_constraint(
    request: GenerationRequest, tool_format: ToolCallFormat, after: str | None,
    close_objects: bool = True,
) -> Constraint | None:
    """The constraint for every choice of `request` (None: free text); `after` is the
    marker the grammar waits for (a reasoning model's end of thinking); `close_objects`:
    an object schema that lists its properties allows no others unless it says so
    (`engine.json_schemas`). A schema or tool the engine cannot enforce is a 400 naming
    the keyword."""
    output = request.output
    if isinstance(output, GrammarOutput):
        return _text_grammar(request, output, after)
    answer = None
    if isinstance(output, JsonObjectOutput):
        answer = constraints.ANY_JSON_OBJECT
    elif isinstance(output, JsonSchemaOutput):
        answer = constraints.JsonAnswer(output.schema, output.strict)
    # Beside tools the calls' grammar holds the answer and checks its schema itself;
    # otherwise (alone, or beside forced calls, where it must still be enforceable) here.
    answer_in_calls = writes_calls(request) and not forces_call(request)
    text_before_calls = answer_in_calls and answer is None  # allowed or strict tools, "auto"
    with _refused(_format_param(output)):
        constraint = None if answer is None or answer_in_calls else constraints.json_schema(
            answer.schema, strict=answer.strict, close_objects=close_objects)
    if writes_calls(request):
        choice = request.tool_choice
        with _refused("tools"):
            constraint = constraints.tool_calls(
                [constraints.FunctionTool(tool.name, tool.parameters, bool(tool.strict))
                 for tool in request.offered_tools],
                name=choice.name if isinstance(choice, NamedFunction) else None,
                parallel=request.parallel_tool_calls is not False,
                call_format=constraints.ToolCallFormat(
                    f"{tool_format.start}\n", f"\n{tool_format.end}", tool_format.separator
                ),
                answer=answer if answer_in_calls else None,
                text=text_before_calls,
                close_objects=close_objects,
                # The text is the model's own up to a call's marker, unless the grammar
                # already waits for another (a reasoning model's end of thinking).
                lazy=after is None,
            )
    if constraint is None:
        return None
    return replace(constraint, after=after) if after else constraint


def _text_grammar(request: GenerationRequest, output: GrammarOutput, after: str | None
                  ) -> Constraint:
    if request.offered_tools:
        raise APIError(400, f"{output.param} cannot go with tools the model may call "
                       '(send tool_choice "none", or no tools)', code="invalid_request",
                       param=output.param)
    build = {"regex": constraints.regex, "choice": constraints.choice,
             "grammar": constraints.grammar}[output.kind]
    try:
        constraint = build(output.definition)
    except constraints.UnsupportedGrammar as error:
        raise APIError(400, f"this server cannot enforce {output.param}: {error}",
                       code="unsupported_grammar", param=output.param) from error
    return replace(constraint, after=after) if after else constraint


@contextmanager
def _refused(param: str) -> Iterator[None]:
    """A schema the builders refuse (UnsupportedSchema, or a schema of odd shape) as the
    400 that names the keyword at fault, and the parameter: the output format's where
    the tool calls' grammar refused its answer."""
    try:
        yield
    except (ValueError, TypeError) as error:
        keyword = getattr(error, "keyword", None)
        keyword = f" (keyword {keyword!r})" if keyword else ""
        if isinstance(error, constraints.UnsupportedAnswer):
            param = "response_format"
        raise APIError(
            400, f"this server cannot enforce the schema{keyword}: {error}",
            code="unsupported_schema", param=param,
        ) from error
