"""The ASGI application: routes, error handlers and middleware around the models."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server.admin import admin
from server.anthropic.adapter import router as messages_api
from server.cohere_embed import router as cohere_embed
from server.config import Settings
from server.http.auth import APIKeyMiddleware
from server.http.body_limit import BodyLimitMiddleware
from server.http.errors import install_error_handlers
from server.http.head import HeadAsGet
from server.http.hosts import ANY_HOST, LocalHostMiddleware, loopback
from server.http.middleware import RequestMiddleware
from server.llama_cpp import router as llama_cpp_api
from server.llama_cpp_embedding import router as llama_cpp_embedding
from server.lmstudio.chat import router as lmstudio_chat
from server.lmstudio.routes import router as lmstudio_api
from server.lmstudio.v1 import router as lmstudio_v1
from server.model_registry import ModelRegistry
from server.ollama.routes import router as ollama_api
from server.openai.routes import api, deepseek_beta
from server.prefill.routes import rerank_aliases
from server.prefill.routes import router as prefill_api
from server.probes import probes
from server.responses.adapter import router as responses_api
from server.state import ServerState
from server.tei_embed import router as tei_embed
from server.tokenize import router as tokenize_api
from server.warm import prefill_warm_prompts
from server.worker_info import worker_info


def create_app(settings: Settings, models: ModelRegistry) -> FastAPI:
    """The app serving `models`, whose engines the caller shuts down."""
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        models.start()
        warming = None
        if settings.warm_prompts is not None:
            warming = asyncio.create_task(prefill_warm_prompts(state, settings.warm_prompts))
        yield
        if warming is not None:
            warming.cancel()
        for model in models.models:
            for task in list(model.background):
                task.cancel()
        models.stop_watching()

    # A path with a trailing slash is a 404, not Starlette's redirect to the path without
    # it, whose Location is built from the request's Host header.
    app = FastAPI(
        title="radix-mlx", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
        lifespan=lifespan, redirect_slashes=False,
    )
    app.state.server = state = ServerState(settings, models)
    # The loads requests wait for are their engine work too: the deadline cancels them.
    state.drain.jobs.add(models)
    app.include_router(api)
    app.include_router(deepseek_beta)
    app.include_router(responses_api)
    app.include_router(messages_api)
    app.include_router(lmstudio_api)
    app.include_router(lmstudio_v1)
    app.include_router(lmstudio_chat)
    app.include_router(ollama_api)
    app.include_router(tokenize_api)
    app.include_router(llama_cpp_api)
    app.include_router(llama_cpp_embedding)
    app.include_router(cohere_embed)
    app.include_router(tei_embed)
    app.include_router(prefill_api)
    app.include_router(rerank_aliases)
    app.include_router(admin)
    app.include_router(probes)
    app.include_router(worker_info)
    install_error_handlers(app)
    app.add_middleware(HeadAsGet)  # innermost: a HEAD is keyed and limited as it came
    # Inside the key's check: a client without the key gets its 401 from the request's
    # head, before a byte of its body is read or held.
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_body_bytes)
    if settings.api_key is not None:
        app.add_middleware(APIKeyMiddleware, key=settings.api_key)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST", "DELETE"],
            # x-api-key, anthropic-*: what Anthropic's browser clients send.
            allow_headers=["authorization", "content-type", "x-request-id", "x-api-key",
                           "anthropic-version", "anthropic-beta"],
        )
    if loopback(settings.host) and ANY_HOST not in settings.allowed_hosts:
        app.add_middleware(LocalHostMiddleware, allowed=settings.allowed_hosts)
    # Added last, so outermost: it sees (and logs) every request, CORS preflights too.
    app.add_middleware(RequestMiddleware, state=state)
    return app
