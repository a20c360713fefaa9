"""OpenAI's Chat Completions and legacy Completions requests, and Mistral's fill in the
middle, as `GenerationRequest`s.

The schema lives in `server.openai.protocol`; this module only maps its fields onto the
internal request (`server.request`), which the shared pipeline runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.api import SamplingKnobs
from engine.image_tokens import MARKER
from engine.tokenizer import ChatEnd
from server.custom_tools import custom_arguments, custom_function
from server.openai.protocol import (
    FOREIGN_OUTPUT_FIELDS,
    AllowedToolsChoice,
    AnyTool,
    AnyToolCall,
    AssistantMessage,
    ChatCompletionRequest,
    ChatRequestMessage,
    CompletionRequest,
    Content,
    CustomTool,
    CustomToolCall,
    FimCompletionRequest,
    ImagePart,
    JsonObjectFormat,
    JsonSchemaFormat,
    NamedChoice,
    PredictionContent,
    SamplingRequest,
    StructuredOutputRequest,
    StructuredOutputs,
    chosen_name,
)
from server.request import (
    TEXT,
    AllowedTools,
    FunctionTool,
    GenerationRequest,
    GrammarOutput,
    Infill,
    JsonObjectOutput,
    JsonSchemaOutput,
    NamedFunction,
    OutputFormat,
    TemplateMessage,
    ToolChoice,
    template_arguments,
    template_call,
    unset_knobs,
)


def chat_request(body: ChatCompletionRequest) -> GenerationRequest:
    return GenerationRequest(
        messages=tuple(template_message(message) for message in body.messages),
        images=tuple(url for message in body.messages for url in content_images(message.content)),
        tools=tuple(function_tool(tool) for tool in body.tools or ()),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        output=output_format(body),
        sampling=sampling_knobs(body),
        unset_sampling=unset_knobs(body),
        prediction=_prediction_text(body.prediction),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        n=body.n,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        stream=body.stream,
        include_usage=_include_usage(body),
        chat_template_kwargs=effort_kwargs(body.reasoning_effort)
        | (body.chat_template_kwargs or {}),
        chat_end=chat_end(body.messages, body.add_generation_prompt,
                          body.continue_final_message),
    )


def chat_end(messages: Sequence[ChatRequestMessage], add_generation_prompt: bool,
             continue_final_message: bool) -> ChatEnd:
    """How the prompt ends after the chat: the reply continues the final message where
    the request says so (vLLM's continue_final_message, or the message marked as the
    reply's start), opens after it, or nothing follows (add_generation_prompt false)."""
    last = messages[-1] if messages else None
    if continue_final_message or (isinstance(last, AssistantMessage) and last.starts_the_reply):
        return "continue"
    return "reply" if add_generation_prompt else "as_is"


def effort_kwargs(effort: str | None) -> dict[str, Any]:
    """A reasoning effort as the template variables vLLM gives it: `reasoning_effort` as
    written (gpt-oss's template reads it), and `enable_thinking` (Qwen3's and Gemma's
    read that), false for "none" and true for any other effort."""
    if not effort:
        return {}
    return {"reasoning_effort": effort, "enable_thinking": effort != "none"}


def custom_tool_names(body: ChatCompletionRequest) -> frozenset[str]:
    """The request's custom tools, whose calls the reply gives as custom calls."""
    return frozenset(tool.custom.name for tool in body.tools or ()
                     if isinstance(tool, CustomTool))


def function_tool(tool: AnyTool) -> FunctionTool:
    """A tool as the model is shown it: a custom tool as a function of one string."""
    if isinstance(tool, CustomTool):
        custom = tool.custom
        return custom_function(custom.name, custom.description, custom.grammar)
    function = tool.function
    return FunctionTool(function.name, function.description, function.parameters,
                        function.strict)


def completion_request(body: CompletionRequest) -> GenerationRequest:
    prompts = body.prompts
    return GenerationRequest(
        prompts=tuple(prompt if isinstance(prompt, str) else tuple(prompt) for prompt in prompts),
        infill=None if body.suffix is None else Infill(body.suffix),
        output=output_format(body),
        sampling=sampling_knobs(body),
        unset_sampling=unset_knobs(body),
        max_tokens=body.max_tokens,
        n=body.n,
        logprobs=body.logprobs,
        echo=body.echo,
        stream=body.stream,
        include_usage=_include_usage(body),
    )


def fim_request(body: FimCompletionRequest) -> GenerationRequest:
    sampling = sampling_knobs(body)
    return GenerationRequest(
        prompts=(body.prompt,),
        infill=Infill(body.suffix),
        sampling=sampling if body.random_seed is None else replace(sampling,
                                                                   seed=body.random_seed),
        unset_sampling=unset_knobs(body),
        max_tokens=body.max_tokens,
        n=body.n,
        stream=body.stream,
        include_usage=_include_usage(body),
    )


def output_format(body: StructuredOutputRequest) -> OutputFormat:
    response_format = body.response_format
    if isinstance(response_format, JsonObjectFormat):
        return JsonObjectOutput()
    if isinstance(response_format, JsonSchemaFormat):
        schema = response_format.json_schema
        return JsonSchemaOutput(schema.name, schema.json_schema, bool(schema.strict))
    return _foreign_output(body) or TEXT


def _foreign_output(body: StructuredOutputRequest) -> OutputFormat | None:
    """The output format of another server's grammar field (one at most is set). Its JSON
    Schemas are not strict: those servers enforce what their grammar engine can."""
    param, given = next(((name, value) for name in FOREIGN_OUTPUT_FIELDS
                         if (value := getattr(body, name)) is not None), (None, None))
    if param is None:
        return None
    kind = FOREIGN_OUTPUT_FIELDS[param]
    if isinstance(given, StructuredOutputs):
        if (constraint := given.constraint()) is None:
            return None
        kind, given = constraint
    if kind == "json_object":
        return JsonObjectOutput()
    if kind == "json":
        return JsonSchemaOutput(param, given, strict=False, param=param)
    return GrammarOutput(kind, tuple(given) if kind == "choice" else given, param)


def sampling_knobs(body: SamplingRequest) -> SamplingKnobs:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingKnobs(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias={int(key): value for key, value in (body.logit_bias or {}).items()},
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        speculation=body.speculation,
    )


def content_text(content: Content | None) -> str | None:
    """Text parts joined the way vLLM joins them, since most templates want a string; an
    image part is its marker there."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(MARKER if isinstance(part, ImagePart) else part.text for part in content)


def content_images(content: Content | None) -> list[str]:
    """The URLs of the content's image parts, in order."""
    if content is None or isinstance(content, str):
        return []
    return [part.image_url.url for part in content if isinstance(part, ImagePart)]


def template_message(message: ChatRequestMessage) -> TemplateMessage:
    """The dict a Hugging Face chat template expects for `message`."""
    out = message.model_dump(exclude_none=True)
    out["content"] = content_text(message.content)
    if isinstance(message, AssistantMessage) and out.pop("refusal", None) is not None \
            and message.content is None:
        out["content"] = message.refusal
    if isinstance(message, AssistantMessage) and message.tool_calls:
        out["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    return out


def _template_call(call: AnyToolCall) -> dict[str, Any]:
    """A call sent back, as a chat template's: its arguments a mapping, which templates
    iterate over (OpenAI sends a JSON string); a custom call's input as the one string of
    the function the model was shown."""
    if isinstance(call, CustomToolCall):
        name, arguments = call.custom.name, custom_arguments(call.custom.input)
    else:
        name, arguments = call.function.name, call.function.arguments
    return template_call(call.id, name, template_arguments(arguments))


def _tool_choice(choice: str | NamedChoice | AllowedToolsChoice | None) -> ToolChoice:
    if isinstance(choice, NamedChoice):
        return NamedFunction(chosen_name(choice))
    if isinstance(choice, AllowedToolsChoice):
        allowed = choice.allowed_tools
        return AllowedTools(allowed.mode, tuple(chosen_name(tool) for tool in allowed.tools))
    return choice or "auto"  # type: ignore[return-value]


def _prediction_text(prediction: PredictionContent | None) -> str:
    if prediction is None:
        return ""
    content = prediction.content
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _include_usage(body: SamplingRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage
