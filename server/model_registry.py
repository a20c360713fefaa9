"""Which engine answers which `model`, and when each one is loaded.

One model configured the old way is served as it always was: its engine starts with the
server, a request that comes while it loads gets a 503, and a failed engine stops the
server (its service manager restarts it). With several models (a models file, or --model
given more than once) every model runs in an engine process of its own, so that a crash
or an out-of-memory costs only that model's open requests:

- a model loads on its first request, which waits (up to `load_timeout`); concurrent first
  requests share one load; a failed load is a 503 naming its cause, and the next request
  tries again;
- the loaded models share one memory budget, each within its share (`memory_bytes`, which
  its engine plans weights, radix cache, running requests' KV and activations inside). A
  model that does not fit first unloads the least recently used idle model that is not
  pinned; a model with requests in flight is never unloaded; when nothing can be freed,
  the request gets a 503 with Retry-After;
- an unpinned model unloads after its idle timeout, or as long after its latest request
  as that request's keep_alive (Ollama's) says. Its disk tier is its own folder, which
  its next load rebuilds the tree from, so an unload loses no cached prefix;
- a model whose engine process died is reloaded by its next request; a pinned one at
  once, and again, backing off, for as long as its loads fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.api import EngineNotReady, Lifecycle
from engine.fill_in_middle import FillInMiddleTokens
from server.config import DEFAULT_MODEL_ID, ModelSpec, Settings
from server.follow_ups import FollowUps
from server.http.drain import shutting_down
from server.http.errors import APIError, shown

if TYPE_CHECKING:
    from engine.api import EngineClient
    from engine.tokenizer import ModelTokenizer

log = logging.getLogger("radix_mlx.server")

# How often loads, idle timeouts and dead engine processes are looked at.
WATCH_SECONDS = 0.25
# A pinned model whose load failed (its engine died again as it reloaded after a crash, or
# its files are broken) is loaded again by the watch, this long after the failure, doubling
# with each failure in a row up to the last: no request need name it to bring it back, and
# /health, which answers 503 while a pinned model is down, recovers by itself.
PINNED_RETRY_SECONDS = (5.0, 300.0)
# What a 503 for a model that cannot be placed now asks the client to wait.
NO_ROOM_RETRY_SECONDS = 5
RETRY_LATER = {"Retry-After": str(NO_ROOM_RETRY_SECONDS)}
# The prompts of one prefill-only job (server/prefill/jobs.py), and how many such jobs a
# model runs at once: together they take at most half its queue (max_queue), the rest
# left to other requests; at the default 256, two jobs of 64, one computing and the next
# queued behind it.
PREFILL_JOB_PROMPTS = 64


def prefill_jobs_at_once(max_queue: int) -> int:
    return max(1, max_queue // (2 * PREFILL_JOB_PROMPTS))

# (spec, its settings, its share of the budget in bytes) -> its engine, started.
StartEngine = Callable[[ModelSpec, Settings, int], "EngineClient"]


class ModelState(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"


@dataclass
class ModelCounters:
    loads: int = 0
    load_seconds: float = 0.0
    unloads: int = 0
    crashes: int = 0  # engine processes that died while serving


class ServedModel:
    """A configured model: its settings (the server's, with its own overrides), its engine
    while loaded, and the requests holding it."""

    def __init__(self, spec: ModelSpec, settings: Settings, share_bytes: int,
                 engine: EngineClient | None = None) -> None:
        self.spec, self.settings, self.share_bytes = spec, settings, share_bytes
        self.engine = engine
        self._context_length: int | None = None
        # What its last load found, kept through an unload: what a client reads of an idle
        # model (Ollama's /api/show: its capabilities, its config) does not shrink then.
        self._model_dir: Path | None = None
        self._capabilities: list[str] | None = None
        self._fill_in_middle: FillInMiddleTokens | None = None
        self.inflight = 0  # requests holding it (a Lease each)
        self.load_waiters = 0  # requests waiting in `acquire` for it to load
        self.last_used = time.monotonic()
        self.loading: asyncio.Task | None = None
        # Being unloaded to make room once its requests finish: new ones wait meanwhile.
        self.evicting = False
        # How long its latest request asked it to stay loaded after it (Ollama's
        # keep_alive, LM Studio's ttl, in seconds; inf: forever; 0: unload once its
        # requests are done); None: its idle timeout. Each request sets it anew (`keep`).
        self.keep_alive: float | None = None
        self.last_error: str | None = None
        self.failed_loads = 0  # in a row
        self.retry_at = 0.0  # pinned and failed: when the watch loads it again
        self.counters = ModelCounters()
        # A cache clear asked for while it was not loaded: done once its load ends.
        self.clear_on_load = False
        # Whether its chats continue, so that next-turn guesses pay (server/next_turn.py).
        self.follow_ups = FollowUps()
        # Engine work no request waits for (next-turn guesses): a clear or an unload
        # cancels it first, as it would put back what a clear lets go of; it holds a lease
        # while it computes.
        self.background: set[asyncio.Task] = set()
        # The prefill-only jobs (server/prefill/jobs.py) on its engine at once, whichever
        # requests they are of: each queues up to 64 prompts in the engine, and five
        # clients classifying lists of 64 at once filled its queue (256): 429s for them
        # and for any chat request meanwhile. The rest wait here instead.
        self.prefill_slots = asyncio.Semaphore(prefill_jobs_at_once(settings.max_queue))

    def learn(self) -> None:
        """Keep what its engine, once ready, says of it: what a client reads of the model
        unloaded (Ollama's /api/show, /v1/models) is what its last load found, whether or
        not a client read it while it was loaded."""
        engine = self.engine
        if engine is None or engine.state is not Lifecycle.READY:
            return
        self._context_length = engine.context_length
        if engine.model_path:
            self._model_dir = engine.model_path
        tokenizer = engine.tokenizer
        if tokenizer is None:
            self._capabilities = [] if engine.is_cross_encoder else ["embedding"]
        else:
            self._capabilities = [
                "completion", "tools", *(["vision"] if tokenizer.images is not None else []),
                *(["thinking"] if tokenizer.thinking is not None else []),
                *(["insert"] if tokenizer.fill_in_middle is not None else [])]
            self._fill_in_middle = tokenizer.fill_in_middle

    @property
    def context_length(self) -> int | None:
        """The engine's context window; None before the model was ever loaded."""
        self.learn()
        return self._context_length

    @property
    def model_dir(self) -> Path | None:
        """The directory its weights and config load from: the loaded engine's, after an
        unload the last one's, before any load its source where that is a local directory
        (None for a hub id or a GGUF file never converted yet)."""
        self.learn()
        if self._model_dir is None:
            source = Path(self.spec.source).expanduser() if self.spec.source else None
            if source is not None and source.is_dir():
                return source
        return self._model_dir

    @property
    def capabilities(self) -> list[str] | None:
        """What it serves, in Ollama's words: "completion" and "tools" for a chat model
        (a template without a tool format gets the generic one), "vision", "thinking",
        "insert" (fill in the middle: a suffix);
        "embedding" for an encoder; none for a cross-encoder, which only reranks (Ollama has
        no word for that), so that clients do not offer it for embedding. None before its
        first load."""
        self.learn()
        return self._capabilities

    @property
    def fill_in_middle(self) -> FillInMiddleTokens | None:
        """Its fill-in-the-middle tokens, as its last load found them."""
        self.learn()
        return self._fill_in_middle

    @property
    def id(self) -> str:
        """The name it answers with. A model configured the old way is called what its
        engine calls it (its directory name or repo id), as it always was."""
        if self.spec.id == DEFAULT_MODEL_ID and self.engine is not None:
            return self.engine.model_id
        return self.spec.id

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([self.id, *self.spec.aliases]))

    @property
    def state(self) -> ModelState:
        if self.engine is None:
            return ModelState.UNLOADED
        if self.engine.state is Lifecycle.READY:
            return ModelState.LOADED
        if self.engine.state is Lifecycle.FAILED:
            return ModelState.UNLOADED
        return ModelState.LOADING

    @property
    def error(self) -> str | None:
        if self.engine is not None and self.engine.state is Lifecycle.FAILED:
            return self.engine.error
        return self.last_error

    def keep(self, seconds: float | None) -> None:
        """The model stays loaded `seconds` after this request (inf: for good), where the
        request says; else its idle timeout (`ModelRegistry.acquire` reset it)."""
        if seconds is not None:
            self.keep_alive = seconds

    def idle_timeout(self) -> float | None:
        """Seconds after its last request that it unloads; None: never."""
        if self.spec.pinned or self.keep_alive == math.inf:
            return None
        if self.keep_alive is not None:
            return self.keep_alive
        return self.spec.idle_timeout or self.settings.model_idle_timeout

    def check_ready(self) -> EngineClient:
        """The engine, ready; 503 before, with Retry-After while it loads (none after a
        failed load, nor for a model of several that nothing is loading: waiting does not
        mend those)."""
        engine = self.engine
        if engine is None:
            if self.loading is None:
                raise APIError(503, f"the model {self.id} is not loaded: a request for it, "
                               f"or POST /admin/models/{self.id}/load, loads it",
                               code="model_not_ready")
            raise APIError(503, f"the model {self.id} is loading", code="model_not_ready",
                           headers=RETRY_LATER)
        if engine.state is Lifecycle.READY:
            return engine
        if engine.state is Lifecycle.FAILED:
            raise APIError(503, f"the model failed to load: {engine.error}",
                           code="model_not_ready")
        raise APIError(503, f"the model is {engine.state.value}", code="model_not_ready",
                       headers=RETRY_LATER)

    def tokenizer(self) -> ModelTokenizer:
        """The tokenizer once the engine is ready; 503 before, 400 for an encoder."""
        engine = self.check_ready()
        if engine.tokenizer is None:  # an EncoderEngine: it says what it serves
            raise APIError(400, f"the model {self.id} is {engine.description}",
                           code="model_not_supported", param="model")
        return engine.tokenizer

    def text_tokenizer(self) -> ModelTokenizer:
        """The tokenizer that counts and shows a text's tokens (/tokenize, /detokenize)
        once the engine is ready: `tokenizer`'s, or an encoder's own, which has nothing to
        chat with but tokenizes; 503 before."""
        engine = self.check_ready()
        return engine.tokenizer or engine.text_tokenizer


class Lease:
    """A request's hold on a model: while any is held, the model is not unloaded."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.engine: EngineClient = model.engine
        self.held = True
        model.inflight += 1
        model.last_used = time.monotonic()

    def release(self) -> None:
        """Idempotent; the route's job calls it when the response ends."""
        if self.held:
            self.held = False
            self.model.inflight -= 1
            self.model.last_used = time.monotonic()


class ModelRegistry:
    """Every configured model, by each of its names."""

    def __init__(self, settings: Settings, start_engine: StartEngine | None,
                 budget_bytes: int, engine: EngineClient | None = None) -> None:
        """`engine`: one model the old way, started already; else `start_engine` starts
        each model's engine when it is first needed."""
        self.settings, self.budget_bytes = settings, budget_bytes
        self.on_demand = engine is None
        self._start_engine = start_engine
        specs = settings.model_specs()
        if engine is not None:  # loaded at start, never unloaded
            specs[0] = specs[0].model_copy(update={"pinned": True})
        shares = model_shares(specs, budget_bytes)
        self.models = [ServedModel(spec, settings.for_model(spec), share)
                       for spec, share in zip(specs, shares, strict=True)]
        if engine is not None:
            self.models[0].engine = engine
        self._placing = asyncio.Lock()  # one placement at a time: room is counted once
        # The shares of engines told to stop whose processes have not exited: still held.
        self._stopping_bytes = 0
        self._watcher: asyncio.Task | None = None
        self.stopping = False  # past the drain's deadline: no load goes on (`cancel`)

    @classmethod
    def of_one(cls, settings: Settings, engine: EngineClient) -> ModelRegistry:
        """One model configured the old way, served by `engine` (started by the caller)."""
        return cls(settings, None, 0, engine)

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    # -- lookup -------------------------------------------------------------------------

    def lookup(self, name: str | None) -> ServedModel:
        """The model `name` means: none (or an alias for none) is the first model; an
        unknown name is a 404, never a load of some path or repo."""
        if name is None or name in self.settings.unnamed_model_aliases:
            return self.default
        # Ollama names a model `name:tag`, `name` alone meaning `name:latest`, and its
        # clients add the tag: a served name with `:latest` is that name.
        untagged = name.removesuffix(":latest")
        for wanted in (name, untagged):
            for model in self.models:
                if wanted in self.names_of(model):
                    return model
        known = [served for model in self.models for served in self.names_of(model)]
        raise APIError(404, f"The model {shown(name, 200)} does not exist; this server serves "
                       f"{known}.",
                       code="model_not_found", param="model")

    def names_of(self, model: ServedModel) -> list[str]:
        """Its id and aliases; the first model's also served_model_names."""
        if model is not self.default:
            return model.names
        return list(dict.fromkeys([*model.names, *self.settings.served_model_names]))

    def name_for(self, model: ServedModel, name: str | None) -> str:
        """What a response says its model is: the name the request used, or the id."""
        return model.id if name is None or name in self.settings.unnamed_model_aliases else name

    # -- requests -----------------------------------------------------------------------

    async def acquire(self, name: str | None) -> Lease:
        """A hold on `name`'s model, loaded: at once when it is, else after its load (with
        several models), at most `load_timeout` seconds away."""
        model = self.lookup(name)
        if not self.on_demand:
            model.check_ready()  # 503 while the one model loads, as always
            return Lease(model)
        deadline = time.monotonic() + self.settings.load_timeout
        model.load_waiters += 1
        waited = False
        try:
            while True:
                self._reap(model)
                if model.evicting:  # its requests finish, then it unloads: load it after
                    await asyncio.sleep(WATCH_SECONDS / 4)
                    if time.monotonic() > deadline:
                        raise self._still_loading(model)
                    continue
                if model.state is ModelState.LOADED:
                    # A request without keep_alive (an Ollama route sets its own once it
                    # holds the model) goes back to the idle timeout, as Ollama's goes back
                    # to its default: a keep_alive 0 before no longer unloads it. One that
                    # waited for the load leaves a stop sent meanwhile to be done after it.
                    if not waited:
                        model.keep_alive = None
                    return Lease(model)
                if model.loading is None:
                    model.loading = asyncio.create_task(self._load(model))
                waited = True
                try:
                    await asyncio.wait_for(self._await_load(model, model.loading),
                                           max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise self._still_loading(model) from None
        finally:
            model.load_waiters -= 1

    def _still_loading(self, model: ServedModel) -> APIError:
        return APIError(503, f"the model {model.id} is not loaded after "
                        f"{self.settings.load_timeout:g} s (load_timeout): its load waits "
                        "for room or takes longer; try again shortly", code="model_not_ready",
                        headers=RETRY_LATER)

    @contextlib.asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[Lease]:
        """`acquire`, released when the block ends: a route that answers in one piece."""
        lease = await self.acquire(name)
        try:
            yield lease
        finally:
            lease.release()

    def is_ready(self, name: str | None) -> bool:
        """Whether a request for `name` would be served without waiting for a load."""
        model = self.lookup(name)
        return not self.on_demand or model.state is ModelState.LOADED

    # -- loading and unloading ---------------------------------------------------------

    async def load(self, model: ServedModel) -> None:
        """Load `model` now (an operator's load), sharing a load under way."""
        if model.state is ModelState.LOADED:
            return
        if model.loading is None:
            model.loading = asyncio.create_task(self._load(model))
        await self._await_load(model, model.loading)

    async def _await_load(self, model: ServedModel, loading: asyncio.Task) -> None:
        """`loading`, the model's load under way, shared: one waiter leaving does not
        cancel it. An unload or the drain's deadline (`cancel`) that cancels it is a 503
        for those waiting, not their own cancellation."""
        try:
            await asyncio.shield(loading)
        except asyncio.CancelledError:
            if not loading.cancelled() or asyncio.current_task().cancelling():
                raise
            if self.stopping:
                raise shutting_down() from None
            raise APIError(503, f"the model {model.id} was unloaded while it loaded",
                           code="model_not_ready", headers=RETRY_LATER) from None

    def cancel(self) -> None:
        """The drain's deadline (the registry is one of its jobs): cancel the loads under
        way, so that the requests waiting for them end with a 503 rather than being
        served by a load that finished after the server began to stop."""
        self.stopping = True
        for model in self.models:
            _cancel_load(model)

    def abandon(self) -> None:
        """The drain's: nothing waits on a cancelled load, whose waiters end at once."""

    async def _load(self, model: ServedModel) -> None:
        try:
            async with self._placing:
                await self._make_room(model)
                log.info("loading model %s from %s (%.1f GiB of the %.1f GiB budget)",
                         model.id, model.spec.source or "the default model",
                         model.share_bytes / 2**30, self.budget_bytes / 2**30)
                engine = self._start_engine(model.spec, model.settings, model.share_bytes)
                model.engine = engine
            started = time.monotonic()
            while engine.state not in (Lifecycle.READY, Lifecycle.FAILED):
                await asyncio.sleep(WATCH_SECONDS / 2)
            # Serving before the tree is rebuilt from the model's disk folder would make the
            # first requests after a reload miss what the unload kept. An engine process
            # that dies meanwhile fails the load: waited for, its rebuild never ends.
            rebuilt_by = time.monotonic() + self.settings.load_timeout
            while (engine.disk is not None and engine.state is Lifecycle.READY
                   and not engine.disk.rebuilt.is_set() and time.monotonic() < rebuilt_by):
                await asyncio.sleep(WATCH_SECONDS / 2)
            if engine.state is Lifecycle.FAILED:
                model.last_error = f"the model {model.id} failed to load: {engine.error}"
                model.failed_loads += 1
                first, most = PINNED_RETRY_SECONDS
                model.retry_at = time.monotonic() + min(
                    most, first * 2 ** (model.failed_loads - 1))
                log.error("%s", model.last_error)
                if model.engine is engine:
                    model.engine = None
                await self._stop(model, engine)
                raise APIError(503, model.last_error, code="model_load_failed",
                               headers=RETRY_LATER)
            while model.clear_on_load:  # asked again during the clear: again
                model.clear_on_load = False
                await self._clear(engine)
            model.learn()
            model.last_error = None
            model.failed_loads = 0
            model.counters.loads += 1
            model.counters.load_seconds += time.monotonic() - started
            model.last_used = time.monotonic()
            log.info("model %s loaded in %.1f s", model.id, time.monotonic() - started)
        finally:
            if model.loading is asyncio.current_task():  # not a later load's
                model.loading = None

    async def _make_room(self, model: ServedModel) -> None:
        """Unload least recently used models until `model`'s share fits: an idle one at
        once; else the least recently used busy one, once its requests have finished (it
        takes no new ones meanwhile: they wait to load it again), so a model waiting for
        room gets it even under a flood of requests for the others. A 503 when pinned and
        loading models hold the room, or when it is not free within load_timeout."""
        deadline = time.monotonic() + self.settings.load_timeout
        pinned = sum(other.share_bytes for other in self.models
                     if other is not model and other.spec.pinned and other.engine is not None)
        if model.share_bytes > self.budget_bytes:  # never, whatever is unloaded
            raise APIError(
                503, f"the model {model.id} needs {model.share_bytes / 2**30:.1f} GiB, more "
                f"than the whole memory budget of {self.budget_bytes / 2**30:.1f} GiB: lower "
                "its memory_bytes or raise memory_limit_bytes", code="model_load_failed")
        if model.share_bytes > self.budget_bytes - pinned:  # unloading others cannot help
            raise self._no_room(model, self.budget_bytes - pinned)
        while (free := self.budget_bytes - self._placed_bytes()) < model.share_bytes:
            movable = self._movable(model)
            if not movable:
                if not self._stopping_bytes and not any(
                        other.loading for other in self.models if other is not model):
                    raise self._no_room(model, free)
                # Loading models hold the room; once loaded, they can make it. Stopping
                # engines give theirs back as their processes exit.
                if time.monotonic() > deadline:
                    raise self._still_loading(model)
                await asyncio.sleep(WATCH_SECONDS / 4)
                continue
            idle = [other for other in movable if other.inflight == 0]
            victim = min(idle or movable, key=lambda other: other.last_used)
            log.info("unloading model %s (least recently used) to make room for %s",
                     victim.id, model.id)
            victim.evicting = True
            try:
                await cancel_background(victim)
                # Until its requests finish, or room comes free otherwise (another model
                # gone idle, unloaded or crashed): then look again.
                while victim.inflight and not self._other_way(model, victim):
                    if time.monotonic() > deadline:
                        raise self._still_loading(model)
                    await asyncio.sleep(WATCH_SECONDS / 4)
                if not victim.inflight:
                    await self.unload(victim)
            finally:
                victim.evicting = False

    def _movable(self, model: ServedModel) -> list[ServedModel]:
        """The loaded models `model` may unload to make room."""
        return [other for other in self.models
                if other is not model and other.engine is not None
                and not other.spec.pinned and other.loading is None]

    def _other_way(self, model: ServedModel, victim: ServedModel) -> bool:
        """Whether `model` now fits without waiting for `victim`: the room is free, or
        another model it may unload is idle."""
        return (self.budget_bytes - self._placed_bytes() >= model.share_bytes
                or any(other is not victim and other.inflight == 0
                       for other in self._movable(model)))

    def _no_room(self, model: ServedModel, free: int) -> APIError:
        return APIError(
            503, f"no room to load the model {model.id}: it needs "
            f"{model.share_bytes / 2**30:.1f} GiB and at most {max(free, 0) / 2**30:.1f} GiB "
            "of the memory budget can be freed; pinned or loading models hold the rest",
            code="model_not_ready", headers=RETRY_LATER)

    def _placed_bytes(self) -> int:
        return self._stopping_bytes + sum(model.share_bytes for model in self.models
                                          if model.engine is not None)

    async def unload(self, model: ServedModel) -> None:
        """Stop `model`'s engine (its disk tier is flushed; the next load restores it).
        Refused (409) while requests hold it or wait for its load under way: cancelling
        that load failed them all with a 503."""
        await cancel_background(model)
        if model.inflight:
            raise APIError(409, f"the model {model.id} has {model.inflight} requests in "
                           "flight", code="model_busy")
        if model.loading is not None and model.load_waiters:
            raise APIError(409, f"the model {model.id} is loading for {model.load_waiters} "
                           "requests", code="model_busy")
        _cancel_load(model)  # a load that still waits for room has no engine
        model.keep_alive = None
        engine, model.engine = model.engine, None
        if engine is None:
            return
        model.counters.unloads += 1
        await self._stop(model, engine)
        log.info("model %s unloaded", model.id)

    async def _stop(self, model: ServedModel, engine: EngineClient) -> None:
        """Stop `engine`, `model`'s, its share of the budget held until it has: a process
        still loading takes up to its stop timeout to end, and another model's load beside
        it had both models' weights in memory."""
        self._stopping_bytes += model.share_bytes
        try:
            await asyncio.to_thread(engine.shutdown)
        finally:
            self._stopping_bytes -= model.share_bytes

    async def unload_once_idle(self, model: ServedModel) -> None:
        """A client's unload (Ollama's keep_alive 0, LM Studio's): `model` now, or while
        requests hold it, once they are done (a request in between keeps it, `acquire`).
        A model that stays loaded, pinned or a server's one, is a 409."""
        if not self.on_demand or model.spec.pinned:
            kept = "pinned" if self.on_demand else "the one this server serves"
            raise APIError(409, f"the model {model.id} stays loaded: it is {kept}")
        try:
            await self.unload(model)
        except APIError as error:
            if error.code != "model_busy":
                raise
            model.keep_alive = 0.0

    async def clear_cache(self, model: ServedModel) -> int | None:
        """Drop `model`'s cached prefixes that no request is using, from memory and disk:
        now if it is loaded (the memory bytes freed), else (with several models) as its
        next load ends, before it serves (None). One model loaded at start must be ready:
        503 before."""
        await cancel_background(model)
        engine = model.engine
        if not self.on_demand:
            try:
                return await self._clear(model.check_ready())
            except EngineNotReady:  # stopped meanwhile: the server is on its way out
                raise APIError(503, "the model's engine stopped", code="model_not_ready",
                               headers=RETRY_LATER) from None
        if engine is None or model.loading is not None or engine.state is not Lifecycle.READY:
            model.clear_on_load = True
            return None
        try:
            return await self._clear(engine)
        except EngineNotReady:  # unloaded (or lost) meanwhile: its disk tier keeps the rest
            model.clear_on_load = True
            return None

    async def _clear(self, engine: EngineClient) -> int:
        # While the tree is being rebuilt from the disk tier's files, a clear would keep
        # what the rebuild reads after it.
        if engine.disk is not None and not await asyncio.to_thread(
                engine.disk.rebuilt.wait, self.settings.load_timeout):
            raise APIError(503, "the disk tier is still being read; try again shortly",
                           code="model_not_ready", headers=RETRY_LATER)
        return await asyncio.wrap_future(engine.clear_cache())

    def _reap(self, model: ServedModel) -> None:
        """A served engine that failed (its process died) is dropped: the next request
        loads the model again, or, pinned, it loads again now."""
        engine = model.engine
        if engine is None or engine.state is not Lifecycle.FAILED or not engine.served:
            return
        model.engine = None
        model.last_error = engine.error
        model.counters.crashes += 1
        if model.spec.pinned:  # always loaded: no request need name it first
            log.error("model %s lost its engine (%s): loading it again", model.id,
                      engine.error)
            model.loading = asyncio.create_task(self._load(model))
            model.loading.add_done_callback(_logged)
            return
        log.error("model %s lost its engine (%s): it reloads on its next request",
                  model.id, engine.error)

    # -- the registry's own life --------------------------------------------------------

    def start(self) -> None:
        """Load the pinned models, and watch idle timeouts and engine deaths (in the
        server's event loop)."""
        if not self.on_demand:
            return
        for model in self.models:
            if model.spec.pinned:
                model.loading = asyncio.create_task(self._load(model))
                model.loading.add_done_callback(_logged)
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Reap crashed engines and unload idle models, for as long as the server runs:
        what goes wrong with one model is logged and the watch goes on (a request that
        took the model while its guesses were cancelled made `unload` a 409, which ended
        the watch, and with it every idle unload and crash reload after)."""
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            now = time.monotonic()
            for model in self.models:
                try:
                    await self._look_after(model, now)
                except APIError as error:
                    log.info("model %s stays loaded: %s", model.id, error)
                except Exception:  # logged; the next model, the next look
                    log.exception("watching model %s failed", model.id)

    async def _look_after(self, model: ServedModel, now: float) -> None:
        self._reap(model)
        if (model.spec.pinned and model.engine is None and model.loading is None
                and not self.stopping and now >= model.retry_at):
            log.error("pinned model %s is not loaded (%s): loading it again", model.id,
                      model.last_error)
            model.loading = asyncio.create_task(self._load(model))
            model.loading.add_done_callback(_logged)
        timeout = model.idle_timeout()
        if (timeout is not None and model.state is ModelState.LOADED
                and model.loading is None and model.inflight == 0
                and now - model.last_used > timeout):
            log.info("model %s idle for %.0f s: unloading", model.id, timeout)
            await self.unload(model)

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for model in self.models:
            _cancel_load(model)

    def shutdown(self) -> None:
        """Stop every engine (each flushes its disk tier), all at once."""
        threads = [threading.Thread(target=engine.shutdown, daemon=True)
                   for _, engine in self.engines()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def engines(self) -> list[tuple[ServedModel, EngineClient]]:
        """The models with an engine, and their engines."""
        return [(model, model.engine) for model in self.models if model.engine is not None]


async def cancel_background(model: ServedModel) -> None:
    """Cancel `model`'s background work and wait until it has let go: a guess that was
    submitted is cancelled in the engine before whatever the caller posts next."""
    tasks = list(model.background)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def model_shares(specs: list[ModelSpec], budget_bytes: int) -> list[int]:
    """Each model's share of the budget: its own `memory_bytes`, or an equal part of what
    the models with one leave."""
    fixed = sum(spec.memory_bytes or 0 for spec in specs)
    open_shares = sum(spec.memory_bytes is None for spec in specs)
    rest = max(budget_bytes - fixed, 0) // max(open_shares, 1)
    return [spec.memory_bytes or rest for spec in specs]


def _logged(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s", task.exception())


def _cancel_load(model: ServedModel) -> None:
    """Cancel `model`'s load under way, if any: those waiting for it get a 503, and the
    model has no load under way from now on. A load cancelled before it began running
    never runs its own cleanup, and left behind would answer every later request for
    the model with that 503."""
    if model.loading is not None:
        model.loading.cancel()
        model.loading = None
