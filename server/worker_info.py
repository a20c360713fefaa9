"""What a cache-aware router asks a worker, beyond /health and the OpenAI routes.

SGLang's router (`sglang-router`, docs/scale-out.md) registers a worker by probing
/health, then reads /server_info and /model_info (falling back to /get_server_info and
/get_model_info, the names older routers and vllm-router use): the served model name
becomes the worker's model id, which the router's /v1/models lists and its per-model
policies key on. Its power-of-two policy polls /get_load. Its /flush_cache is sent on to
every worker's (ours drops the unpinned prefix cache, as DELETE /admin/cache does), and
/health_generate, a health check that runs the model, to a worker's (ours generates one
token). Answers are SGLang's shapes, with the engine's real values; the model must be
ready (503 before, like every /v1 route).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import tomllib
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from engine.api import EngineClient, EngineError, EngineStats, SamplingParams
from server.admin import cleared, engine_stats
from server.http.errors import APIError
from server.http.json_body import JSONRoute
from server.metrics import read_stats
from server.model_registry import ServedModel
from server.state import ServerState, server_state

worker_info = APIRouter(route_class=JSONRoute)

# /health_generate's one token: a worker that cannot give it in this long is unhealthy
# (SGLang's own health check waits 20 s too).
HEALTH_GENERATE_SECONDS = 20.0


class ServerInfo(BaseModel):
    """SGLang's server_info fields that mean something here."""

    model_path: str
    served_model_name: str
    served_model_names: list[str]
    version: str
    dp_size: int = 1
    tp_size: int = 1
    context_length: int
    max_req_input_len: int
    max_running_requests: int
    max_queued_requests: int
    max_total_tokens: int  # prompt + max_tokens of running requests the memory plan holds
    cache_bytes: int  # the radix tree's budget


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str
    is_generation: bool = True
    context_length: int
    vocab_size: int


class WorkerLoad(BaseModel):
    """One data-parallel rank's load (we have one): requests waiting or running, and the
    tokens (prompt + max_tokens) the running ones hold, which is what the router sums."""

    dp_rank: int = 0
    num_reqs: int
    num_waiting_reqs: int
    num_running_reqs: int
    num_tokens: int


@functools.cache
def server_version() -> str:
    """The installed distribution's version; from a source checkout that is not
    installed (the GPU machines run one), the version its pyproject.toml names."""
    try:
        return importlib.metadata.version("radix-mlx")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
        return str(project["project"]["version"])
    except (OSError, ValueError, KeyError):
        return "0+unknown"


def _ready(request: Request) -> tuple[ServerState, ServedModel]:
    """The server and its first model (a router's worker serves one), once loaded."""
    state = server_state(request)
    model = state.models.default
    model.check_ready()  # 503 while loading: the router retries registration
    return state, model


@worker_info.get("/server_info")
@worker_info.get("/get_server_info")
async def server_info(request: Request) -> ServerInfo:
    state, model = _ready(request)
    engine = model.engine
    stats = await engine_stats(engine)
    names = state.models.names_of(model)
    return ServerInfo(
        model_path=engine.config.model,
        served_model_name=names[0],
        served_model_names=names,
        version=server_version(),
        context_length=engine.context_length,
        max_req_input_len=engine.context_length - 1,
        max_running_requests=engine.config.max_batch_size,
        max_queued_requests=engine.config.max_queue,
        max_total_tokens=stats.kv_token_capacity,
        cache_bytes=stats.tree.capacity_bytes,
    )


@worker_info.get("/model_info")
@worker_info.get("/get_model_info")
async def model_info(request: Request) -> ModelInfo:
    _, model = _ready(request)
    engine = model.engine
    generates = engine.tokenizer is not None  # else an encoder, which embeds or scores
    return ModelInfo(
        model_path=engine.config.model, tokenizer_path=engine.config.model,
        is_generation=generates, context_length=engine.context_length,
        vocab_size=engine.tokenizer.vocab_size if generates else engine.vocab_size,
    )


@worker_info.get("/get_load")
async def get_load(request: Request) -> list[WorkerLoad]:
    """The queue and running batch now; answered before the model is ready too (all
    zeros then), since a load probe must not fail a worker that is still loading."""
    engines = server_state(request).models.engines()
    stats = EngineStats()
    if engines:  # off the loop: a hung engine process's wait out their timeout (zeros)
        stats = (await asyncio.to_thread(read_stats, engines[0]))[1] or stats
    return [WorkerLoad(
        num_reqs=stats.waiting + stats.running, num_waiting_reqs=stats.waiting,
        num_running_reqs=stats.running, num_tokens=stats.tokens_in_flight,
    )]


# POST only, as every sgl-router sends it (SGLang's own server takes GET too): a GET is
# what any web page can make a browser send, by an image's URL, with no Origin to check.
@worker_info.post("/flush_cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    """Drop the prefix cache that no request is using (requests keep what they hold), of
    every model: each one's memory freed and tiers, or that its next load clears it."""
    models = server_state(request).models
    flushed = [{"id": served.id, **await cleared(models, served)} for served in models.models]
    return {"cleared": True,
            "memory_bytes_freed": sum(model["memory_bytes_freed"] for model in flushed),
            "models": flushed}


@worker_info.get("/health_generate")
async def health_generate(request: Request) -> dict[str, str]:
    """Healthy only if the engine generates a token now: a real step through the
    scheduler and the model, which /health (a state) does not show. An encoder, which
    generates nothing, runs one small forward instead."""
    _, model = _ready(request)
    engine = model.engine
    try:
        async with asyncio.timeout(HEALTH_GENERATE_SECONDS):
            if engine.tokenizer is None:
                await asyncio.wrap_future(engine.probe())
            else:
                await _one_token(engine)
    except TimeoutError:
        raise APIError(503, f"not healthy: no answer in {HEALTH_GENERATE_SECONDS:.0f} s",
                       code="unhealthy") from None
    except EngineError as error:
        raise APIError(503, f"not healthy: {error}", code="unhealthy") from None
    return {"status": "ok"}


async def _one_token(engine: EngineClient) -> None:
    stream = engine.submit(engine.tokenizer.encode("ping"),
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    try:
        async for _ in stream:
            pass
    finally:
        stream.cancel()  # a no-op once it has finished
