"""Ollama's native API under /api: what clients built for Ollama call (its Python and
JavaScript libraries, Open WebUI, editors' Ollama providers), answered by the same
engines and cache as the OpenAI and Anthropic routes.

/api/chat and /api/generate (streamed as JSON lines unless `stream: false`; an empty
chat or prompt loads the model, and with `keep_alive: 0` unloads it, as `ollama stop`
asks, once its running requests are done; any request's keep_alive is how long its model
stays loaded after it, with several models), /api/embed and the older /api/embeddings,
/api/tags (the configured models), /api/ps (the loaded ones), /api/show and
/api/version. Pulling, pushing, creating,
copying and deleting models are Ollama's model store's, which this server does not keep:
those paths are a 404.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.embedding_config import hidden_size
from engine.weights_summary import human_number
from server.clock import Clock
from server.http.errors import APIError
from server.http.json_body import AnyTypeJSONRoute
from server.http.loading import respond_with_model
from server.http.model_response import model_response
from server.http.openapi import error_responses, json_lines
from server.http.streaming import CLIENT_CLOSED, JSONLinesSource, to_the_end
from server.metrics import read_stats
from server.model_facts import capabilities, model_config, model_facts, weight_files_bytes
from server.model_registry import Lease, ModelState, ServedModel
from server.ollama.adapter import (
    OllamaReply,
    chat_request,
    context_window,
    created_at,
    for_template,
    generate_request,
    truncated,
    whole,
)
from server.ollama.protocol import (
    OLLAMA_VERSION,
    ChatChunk,
    ChatRequest,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbedRequest,
    EmbedResponse,
    ErrorResponse,
    GenerateChunk,
    GenerateRequest,
    GenerationFields,
    ListedModel,
    ModelDetails,
    ModelList,
    OutMessage,
    RunningModel,
    RunningModels,
    ShowRequest,
    ShowResponse,
    Version,
)
from server.pipeline import GenerationRun, start
from server.prefill.routes import embed_texts, normalised
from server.request import GenerationRequest
from server.state import ServerState, server_state

# A model's sampling defaults by the names of Ollama's parameters, where they differ.
OLLAMA_PARAMETER = {"repetition_penalty": "repeat_penalty"}
# 9999-12-31T23:59:59Z: a pinned model's expiry.
NEVER = 253402300799

router = APIRouter(prefix="/api", responses=error_responses(ErrorResponse),
                   route_class=AnyTypeJSONRoute)


def _streamed(chunk: type) -> dict[int | str, dict[str, Any]]:
    """A 200 of a whole answer (the last chunk, done) or, unless `stream` is false,
    the chunks as JSON lines."""
    return {200: {"model": chunk, "content": json_lines(chunk, ErrorResponse)}}


@router.post("/chat", responses=_streamed(ChatChunk))
async def chat(body: ChatRequest, request: Request) -> Response:
    if not body.messages:
        return await _load_or_unload(request, body, chat=True)
    return await _reply(request, body, chat_request(body), chat=True)


@router.post("/generate", responses=_streamed(GenerateChunk))
async def generate(body: GenerateRequest, request: Request) -> Response:
    if not body.prompt and not body.images:
        return await _load_or_unload(request, body, chat=False)
    return await _reply(request, body, generate_request(body), chat=False)


async def _reply(request: Request, body: GenerationFields, generation: GenerationRequest,
                 chat: bool) -> Response:
    """The model's reply, streamed or whole; a stream's status line waits for the model's
    load, as Ollama's does, so a failed load is still an error status."""
    state, clock = server_state(request), Clock()

    async def respond(lease: Lease) -> Response:
        clock.ready()
        if body.think and "thinking" not in (lease.model.capabilities or []):
            # Ollama's answer: thinking asked of a model that cannot is an error, not
            # a reply that silently lacks it.
            raise APIError(400, f'"{body.model}" does not support thinking')
        lease.model.keep(body.keep_alive)
        served = for_template(generation, lease.model.tokenizer().chat_template_text)

        async def shorter() -> GenerationRequest:
            return await truncated(lease, served, body.options)

        run = await start(request, state, lease, served, shorter if body.truncate else None)
        reply = OllamaReply(state.models.name_for(lease.model, body.model), clock, chat)
        if body.stream:
            return JSONLinesSource(run, _lines(run, reply))
        objects = await to_the_end(request, run, _objects(run, reply))
        if objects is None:
            return Response(status_code=CLIENT_CLOSED)
        return model_response(whole(objects), exclude_none=True)

    return await respond_with_model(state.models, body.model, False, respond, _error_line)


async def _objects(run: GenerationRun, reply: OllamaReply) -> list[ChatChunk | GenerateChunk]:
    return [out async for event in run.events() for out in reply.objects(event)]


async def _lines(run: GenerationRun, reply: OllamaReply) -> AsyncIterator[list[str]]:
    try:
        async for event in run.events():
            yield reply.lines(event)
    except APIError as error:
        # The status line is sent already: the error is the stream's last line, as
        # Ollama's own.
        yield [_error_line(error)]


def _error_line(error: APIError) -> str:
    return ErrorResponse(error=error.message).model_dump_json()


async def _load_or_unload(request: Request, body: GenerationFields, chat: bool) -> Response:
    """An empty chat or prompt: load the model (and answer at once), or with keep_alive 0
    unload it."""
    models = server_state(request).models
    served = models.lookup(body.model)
    if body.keep_alive == 0:
        await models.unload_once_idle(served)
        reason = "unload"
    else:
        await _load(request, body.model, body.keep_alive)
        reason = "load"
    fields: dict[str, Any] = {"model": models.name_for(served, body.model),
                              "created_at": created_at(), "done": True, "done_reason": reason}
    done = (ChatChunk(**fields, message=OutMessage()) if chat
            else GenerateChunk(**fields, response=""))
    return model_response(done, exclude_none=True)


# -- embeddings ---------------------------------------------------------------------------


@router.post("/embed")
async def embed(body: EmbedRequest, request: Request) -> Response:
    clock = Clock()
    name = body.model
    inputs = body.input if isinstance(body.input, list) else [body.input] * bool(body.input)
    if not inputs:  # Ollama's way to load an embedding model
        return model_response(EmbedResponse(model=await _load(request, name, body.keep_alive),
                                            embeddings=[],
                                            prompt_eval_count=0,
                                            total_duration=max(clock.elapsed(), 1)))
    # As Ollama's: inputs are cut to (or, without truncate, refused over) num_ctx, within
    # the model's window.
    embedded = await embed_texts(request, name, inputs, None, -1 if body.truncate else None,
                                 window=context_window(body.options))
    if embedded is None:
        return Response(status_code=CLIENT_CLOSED)
    server_state(request).models.lookup(name).keep(body.keep_alive)
    name, vectors, prompt_tokens, _ = embedded
    # Ollama cuts any model's vectors, trained for it or not, and ignores a size that is
    # not under the model's own (OpenAI's endpoint refuses both).
    if body.dimensions is not None and 0 < body.dimensions < vectors.shape[1]:
        vectors = normalised(vectors[:, :body.dimensions])
    return model_response(EmbedResponse(
        model=name, embeddings=vectors.tolist(), prompt_eval_count=prompt_tokens,
        total_duration=max(clock.elapsed(), 1)))


@router.post("/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> Response:
    name = body.model
    if not body.prompt:
        await _load(request, name, body.keep_alive)
        return model_response(EmbeddingsResponse(embedding=[]))
    embedded = await embed_texts(request, name, [body.prompt], None, -1)
    if embedded is None:
        return Response(status_code=CLIENT_CLOSED)
    server_state(request).models.lookup(name).keep(body.keep_alive)
    return model_response(EmbeddingsResponse(embedding=embedded[1][0].tolist()))


async def _load(request: Request, name: str, keep_alive: float | None) -> str:
    """Load the model `name` names, if it is not, and answer with its name."""
    models = server_state(request).models
    async with models.use(name) as lease:
        lease.model.keep(keep_alive)
        return models.name_for(lease.model, name)


# -- models ---------------------------------------------------------------------------------


@router.post("/pull", include_in_schema=False)
@router.post("/push", include_in_schema=False)
@router.post("/create", include_in_schema=False)
@router.post("/copy", include_in_schema=False)
@router.delete("/delete", include_in_schema=False)
async def model_store(request: Request) -> None:
    """Ollama's model store, which this server does not keep: a 404 that says so, where
    the bare "Not Found" of an unknown path read as a wrong base URL (`ollama pull`)."""
    models = server_state(request).models
    served = [name for model in models.models for name in models.names_of(model)]
    raise APIError(404, f"{request.url.path} is Ollama's model store, which this server "
                   f"does not keep: it serves the models it is configured with, {served}")


@router.get("/version")
async def version() -> Version:
    return Version(version=OLLAMA_VERSION)


@router.get("/tags")
async def tags(request: Request) -> ModelList:
    """Every configured model under each of its names, loaded or not."""
    state = server_state(request)
    sizes = {model: weight_files_bytes(model, model_facts(model))
             for model in state.models.models}
    return ModelList(models=[_listed(state, model, name, sizes[model])
                             for model in state.models.models
                             for name in state.models.names_of(model)])


@router.get("/ps")
async def running(request: Request) -> RunningModels:
    """The loaded models, each until its idle timeout after its last request (a pinned
    one's: never, the last time RFC 3339 writes)."""
    state = server_state(request)
    sizes, listed = await _sizes(state), []
    for model in state.models.models:
        if model.state is not ModelState.LOADED:
            continue
        timeout = model.idle_timeout()
        # Busy, it stays at least the timeout from now, as Ollama's does.
        idle = time.monotonic() - model.last_used if model.inflight == 0 else 0.0
        expires = NEVER if timeout is None else time.time() - idle + timeout
        entry = _listed(state, model, model.id, sizes.get(model, 0))
        listed.append(RunningModel(
            **entry.model_dump(), size_vram=entry.size, context_length=model.context_length or 0,
            expires_at=_stamp(min(expires, NEVER))))
    return RunningModels(models=listed)


@router.post("/show")
async def show(body: ShowRequest, request: Request) -> ShowResponse:
    state = server_state(request)
    name = body.model or body.name
    if not name:
        raise APIError(400, "model is required", param="model")
    model = state.models.lookup(name)
    details, config = _details(model), model_config(model)
    family = details.family or "model"
    info: dict[str, Any] = {"general.architecture": family}
    if model.context_length:
        info[f"{family}.context_length"] = model.context_length
    width = _embedding_length(model, config)
    if width:
        info[f"{family}.embedding_length"] = width
    # As a Modelfile's parameters: its sampling defaults, and its context window, which
    # clients (Continue) size their prompts by where a Modelfile sets num_ctx.
    parameters = {OLLAMA_PARAMETER.get(key, key): value for key, value
                  in model.spec.sampling.model_dump(exclude_none=True).items()}
    if model.context_length:
        parameters["num_ctx"] = model.context_length
    return ShowResponse(
        modelfile=f"FROM {model.spec.source or model.id}\n",
        parameters="\n".join(f"{key} {value}" for key, value in parameters.items()),
        template=_template(model, config), details=details,
        model_info=info, capabilities=capabilities(model),
        modified_at=_stamp(state.started))


async def _sizes(state: ServerState) -> dict[ServedModel, int]:
    """Each loaded model's weight bytes in memory (/api/ps' `size`), read off the loop
    and all at once: a stopped or stuck engine process (until step_timeout kills it) does
    not answer for its stats, and waited for on the loop, it stalled every stream of every
    model 5 s a listed name, then made the listing a 500. Such a model is listed with no
    size."""
    loaded = [served for served in state.models.engines()
              if served[0].state is ModelState.LOADED]
    read = await asyncio.gather(*(asyncio.to_thread(read_stats, served) for served in loaded))
    return {model: stats.weight_bytes for model, stats in read if stats is not None}


def _listed(state: ServerState, model: ServedModel, name: str, size: int) -> ListedModel:
    digest = hashlib.sha256(f"{model.id}\0{model.spec.source}".encode()).hexdigest()
    return ListedModel(name=name, model=name, modified_at=_stamp(state.started), size=size,
                       digest=digest, details=_details(model))


def _details(model: ServedModel) -> ModelDetails:
    facts = model_facts(model)
    return ModelDetails(
        format=facts.format, family=facts.family,
        families=[facts.family] if facts.family else [],
        parameter_size=human_number(facts.parameters) if facts.parameters is not None else "",
        quantization_level=f"Q{facts.bits}" if facts.bits else facts.dtype)


def _embedding_length(model: ServedModel, config: dict[str, Any]) -> int | None:
    """How many values the model's embeddings have, which clients size a vector index
    by: a loaded encoder's (after its pooling and any dense layer), else the hidden size
    its config names (a causal model embeds its last hidden state)."""
    loaded = model.state is ModelState.LOADED
    return (getattr(model.engine, "dimensions", 0) if loaded else 0) or hidden_size(config)


def _template(model: ServedModel, config: dict[str, Any]) -> str:
    """Its chat template; for a model that fills in the middle, inside the clause for a
    suffix that Ollama's templates of such models open with: Continue offers a model for
    autocomplete where its template reads `.Suffix`."""
    chat = str(config.get("chat_template") or "")
    tokens = model.fill_in_middle
    if tokens is None:
        return chat
    prefix, suffix = tokens.names[:2]
    if tokens.suffix_first:  # Ollama's codestral template
        infill = f"{suffix}{{{{ .Suffix }}}}{prefix} {{{{ .Prompt }}}}"
    else:
        infill = f"{prefix}{{{{ .Prompt }}}}{suffix}{{{{ .Suffix }}}}{tokens.names[2]}"
    return f"{{{{- if .Suffix }}}}{infill}{{{{- else }}}}{chat}{{{{- end }}}}"


def _stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")
