"""The `serve` process: logging, the engine (loading in the background so /health answers
at once), and uvicorn with a drain on SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from types import FrameType

import uvicorn

from engine.api import EngineClient, EngineConfig, Lifecycle, SpeculationConfig
from engine.encoder import EncoderEngine, is_encoder_model
from engine.engine import Engine
from engine.gguf import GGUFError
from engine.memory import CPU_MEMORY_FRACTION
from engine.model_source import resolve_model
from engine.platform_info import describe_platform
from engine.process import EngineProcess
from server.app import create_app
from server.config import ConfigError, ModelSpec, Settings, default_disk_cache_dir, load_settings
from server.http.drain import CANCEL_GRACE_SECONDS, Drain
from server.http.uvicorn_protocol import BoundedProtocol
from server.launch import tensor_parallel
from server.launch.env import in_launch
from server.launch.logs import configure_logging
from server.model_registry import ModelRegistry

log = logging.getLogger("radix_mlx.server")
# The soft limit of open files the server raises itself to where the hard one allows
# (macOS's OPEN_MAX).
OPEN_FILES = 10240


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT/SIGHUP drains instead of closing at
    once: new requests get 503 (load balancers see /health go 503 too), in-flight ones get
    up to `timeout` seconds, then whatever is left is cancelled and the process exits 0.
    A second signal ends what is in flight at once, each response with its error event,
    and exits within a second; a third stops at once. So does `failed()` turning true (the
    one model failed). SIGHUP (a closed terminal or ssh session; a logrotate hook) ended
    the process at once, every stream cut mid-chunk with no log line."""

    def __init__(
        self, config: uvicorn.Config, drain: Drain, timeout: float,
        failed: Callable[[], bool],
    ) -> None:
        super().__init__(config)
        self._drain, self._timeout, self._failed = drain, timeout, failed

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        hangup = signal.signal(signal.SIGHUP, self.handle_exit)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, hangup)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recording the signal (as uvicorn does) keeps it from being re-raised after
        # shutdown, which would make a clean drain exit with "killed by SIGTERM".
        if self._drain.hurried:
            self.should_exit = self.force_exit = True
            return
        if self._drain.draining:
            log.info("second signal: ending %d requests in flight now", self._drain.inflight)
            self._drain.hurry()
            return
        log.info("draining: refusing new requests, waiting up to %.0f s for %d in flight",
                 self._timeout, self._drain.inflight)
        self._drain.begin(self._timeout)

    async def on_tick(self, counter: int) -> bool:
        if self._drain.draining and self._drain.finished():
            if self._drain.hurried:
                # What a second signal left in flight holds no job to end (a body still
                # arriving, an embedding): its connection closes, and it ends as one whose
                # client left, where uvicorn would wait its graceful timeout, then cancel
                # it with a traceback.
                for connection in list(self.server_state.connections):
                    connection.transport.abort()
            self.should_exit = True
        # Answering 503 forever would hide the failure from a service manager.
        if self._failed():
            self.should_exit = True
        return await super().on_tick(counter)


def engine_config(settings: Settings, model: str, memory_limit_bytes: int | None = None
                  ) -> EngineConfig:
    """`model`'s engine under `settings` (a model's own, with its overrides); with several
    models, `memory_limit_bytes` is its share of the budget."""
    return EngineConfig(
        model=model,
        gguf_dtype=settings.gguf_dtype,
        context_length=settings.context_length,
        cache_bytes=settings.cache_bytes,
        cache_fraction=settings.cache_fraction,
        max_batch_size=settings.max_batch_size,
        prefill_batch_size=settings.prefill_batch_size,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
        prefill_stall_ratio=settings.prefill_stall_ratio,
        prefill_stall_floor_seconds=settings.prefill_stall_floor_ms / 1000,
        max_tokens_in_flight=settings.max_tokens_in_flight,
        memory_limit_bytes=memory_limit_bytes or settings.memory_limit_bytes,
        memory_share=settings.memory_share,
        max_queue=settings.max_queue,
        disk_cache_dir=str(settings.disk_cache_dir or default_disk_cache_dir()),
        disk_cache_bytes=settings.disk_cache_bytes,
        kv_bits=settings.kv_bits,
        kv_group_size=settings.kv_group_size,
        collective_timeout=settings.collective_timeout,
        step_timeout=settings.step_timeout,
        chat_template=(None if settings.chat_template is None
                       else settings.chat_template.read_text(encoding="utf-8")),
        speculation=speculation_config(settings),
        warm_up={"auto": None, "on": True, "off": False}[settings.warm_up],
    )


def speculation_config(settings: Settings) -> SpeculationConfig:
    """The server's speculation; a draft model drafts after the sources named."""
    sources = tuple(settings.speculation_sources)
    if settings.speculation_draft_model and "model" not in sources:
        sources += ("model",)
    return SpeculationConfig(settings.speculation, settings.speculation_max_draft, sources,
                             settings.speculation_draft_model or "")


def memory_budget_bytes(settings: Settings) -> int:
    """What several models share: memory_limit_bytes, or memory_share of what the
    machine's memory allows (Metal's default working set on a Mac: three quarters)."""
    if settings.memory_limit_bytes is not None:
        return settings.memory_limit_bytes
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    usable = physical * 3 // 4 if sys.platform == "darwin" else int(physical * CPU_MEMORY_FRACTION)
    return int(usable * settings.memory_share)


def start_model_engine(spec: ModelSpec, settings: Settings, share_bytes: int) -> EngineClient:
    """A model of several: an encoder in this process, any other in a process of its own
    (a crash there costs that model's requests only). Its GGUF file is converted there."""
    config = engine_config(settings, spec.source, share_bytes)
    engine: EngineClient
    if is_encoder_model(spec.source):
        engine = EncoderEngine(config)
    else:
        engine = EngineProcess(config, partial(configure_logging, settings.log_level,
                                               settings.log_file))
    engine.start()
    return engine


def run(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT, then drain; the exit status: 1 if the one model failed
    to load, with the reason as stderr's last line, else 0. One model's GGUF file is
    checked and converted before any port opens; with several, each model's is converted
    as it loads."""
    configure_logging(settings.log_level, settings.log_file)
    _raise_open_files_limit()
    # Until uvicorn installs its draining handlers, a stop has nothing to drain.
    signal.signal(signal.SIGTERM, _stop_before_serving)
    if settings.several_models:
        models = ModelRegistry(settings, start_model_engine, memory_budget_bytes(settings))
        return _serve(settings, models, failed=lambda: False)
    if not settings.engine_process or settings.tensor_parallel > 1:
        # Else the engine's process says it: asking MLX for its device here could open
        # a GPU context in a process that never computes.
        log.info("%s", describe_platform())
    try:
        model = resolve_model(settings.model[0] if settings.model else None,
                              settings.gguf_dtype)
    except GGUFError as error:
        print(f"radix-mlx serve: {error}", file=sys.stderr)
        return 1
    group = None
    config = engine_config(settings, model)
    if settings.tensor_parallel > 1:
        if not in_launch():
            return tensor_parallel.launch(settings, model)
        group = tensor_parallel.join(settings)
        if group is None:
            return 1
        if not group.leader:
            return tensor_parallel.run_rank(config, group)
    engine: EngineClient
    if group is None and settings.engine_process and not is_encoder_model(model):
        # Its own process, so the HTTP work here never takes the GIL its thread needs.
        engine = EngineProcess(config, partial(configure_logging, settings.log_level,
                                               settings.log_file))
    elif group is None and is_encoder_model(model):
        engine = EncoderEngine(config)
    else:  # a tensor-parallel rank group runs its engine in the process that joined it
        engine = Engine(config, group)
        tensor_parallel.fail_when_a_rank_exits(engine)
    engine.start()
    status = _serve(settings, ModelRegistry.of_one(settings, engine),
                    failed=lambda: engine.state is Lifecycle.FAILED)
    if engine.state is Lifecycle.FAILED:
        reason = engine.error if engine.served else f"the model failed to load: {engine.error}"
        print(f"radix-mlx serve: {reason}", file=sys.stderr)
        if engine.served:
            # Its thread may still be inside a step that never ends, where the
            # interpreter's shutdown would wait for it or abort under it.
            logging.shutdown()
            sys.stderr.flush()
            os._exit(1)
        return 1
    if not engine.served:
        # Stopped (or its port taken) while the engine's thread loads or warms up the
        # model, inside MLX: the interpreter's shutdown under it aborts the process
        # (std::terminate, exit 134), which a service manager counts as a crash. Nothing
        # is left to save.
        logging.shutdown()
        os._exit(status)
    return status


def _raise_open_files_limit() -> None:
    """Every connection holds a file descriptor, and so does each disk-tier file read.
    Service managers give few by default (launchd: 256): the soft limit
    is raised to the hard one, up to OPEN_FILES, as nginx's worker_rlimit_nofile does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as error:  # macOS refuses more than its kernel's cap
            log.warning("open files stay at %d: %s", soft, error)


def _serve(settings: Settings, models: ModelRegistry, failed: Callable[[], bool]) -> int:
    app = create_app(settings, models)
    http = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=functools.partial(BoundedProtocol, head_timeout=settings.request_head_timeout,
                               write_timeout=settings.write_timeout),
        log_config=None,  # keep the logging configured above
        access_log=False,  # radix_mlx.access writes a richer line
        # The drain above already waited for in-flight requests; uvicorn only closes
        # connections, so the whole stop stays within drain_timeout plus a few seconds
        # (the service files allow drain_timeout + 5 s before SIGKILL).
        timeout_graceful_shutdown=CANCEL_GRACE_SECONDS,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
    )
    status = 0
    try:
        DrainingServer(http, app.state.server.drain, settings.drain_timeout, failed).run()
    except SystemExit as stop:  # uvicorn's, when it cannot bind the port: its status
        status = stop.code if isinstance(stop.code, int) else 1
    finally:
        models.shutdown()
        app.state.server.close_stores()
    return status


def _stop_before_serving(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def serve_command(args: argparse.Namespace) -> int:
    """`radix-mlx serve` and `python -m server`: settings from flags, env and file."""
    try:
        settings = load_settings(args)
    except ConfigError as error:
        print(f"radix-mlx serve: {error}", file=sys.stderr)
        return 2
    return run(settings)
