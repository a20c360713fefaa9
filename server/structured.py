"""The grammar a request's output must follow: forced tool calls and structured output.

- tool_choice "required" or a named function (with tools offered): the reply is one call
  (several in a row only if parallel_tool_calls is explicitly true: SmolLM2-135M, allowed
  more, repeated its call until max_tokens) whose arguments validate against the
  function's parameters, written in the request's tool-call format.
- otherwise a `json_object` / `json_schema` output format: the reply is that JSON. With
  tools offered and tool_choice "auto" the model must stay free to call a tool instead,
  so the output format is not enforced then (the grammar engine's seam has no "a call or
  this JSON" grammar yet).

Stop sequences end free text only: a constrained reply ends where its grammar ends, so
they are not applied to it (a stop string inside a JSON string would cut it invalid).
For a reasoning model the grammar starts after the end-of-thinking marker.
"""

from __future__ import annotations

from dataclasses import replace

from engine import constraints
from engine.api import Constraint
from engine.tokenizer import ToolCallFormat
from server.errors import APIError
from server.generation import (
    GenerationRequest,
    JsonObjectOutput,
    JsonSchemaOutput,
    NamedFunction,
)


def forces_call(request: GenerationRequest) -> bool:
    return bool(request.offered_tools) and (
        request.tool_choice == "required" or isinstance(request.tool_choice, NamedFunction)
    )


def output_constraint(
    request: GenerationRequest, tool_format: ToolCallFormat, after: str | None
) -> Constraint | None:
    """The constraint for every choice of `request` (None: free text); `after` is the
    marker the grammar waits for (a reasoning model's end of thinking). A schema or tool
    the engine cannot enforce is a 400 naming the keyword."""
    output = request.output
    param = "tools" if forces_call(request) else "response_format"
    try:
        if forces_call(request):
            choice = request.tool_choice
            name = choice.name if isinstance(choice, NamedFunction) else None
            constraint = constraints.tool_calls(
                [constraints.FunctionTool(tool.name, tool.parameters, bool(tool.strict))
                 for tool in request.offered_tools],
                name=name, parallel=request.parallel_tool_calls is True,
                call_format=constraints.ToolCallFormat(
                    f"{tool_format.start}\n", f"\n{tool_format.end}", "\n"
                ),
            )
        elif request.offered_tools and request.tool_choice == "auto":
            return None
        elif isinstance(output, JsonObjectOutput):
            constraint = constraints.json_object()
        elif isinstance(output, JsonSchemaOutput):
            constraint = constraints.json_schema(output.schema, strict=output.strict)
        else:
            return None
    except (ValueError, TypeError) as error:  # UnsupportedSchema, or a schema of odd shape
        keyword = getattr(error, "keyword", None)
        keyword = f" (keyword {keyword!r})" if keyword else ""
        raise APIError(
            400, f"this server cannot enforce the schema{keyword}: {error}",
            code="unsupported_schema", param=param,
        ) from error
    return replace(constraint, after=after) if after else constraint
