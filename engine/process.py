"""The engine in a child process, so that the HTTP server's work never takes the GIL that
the engine's thread needs to build MLX graphs.

MLX on a GPU is host-bound for small models: the engine thread's Python is most of a
decode step, and in one process every token's HTTP work (uvicorn, starlette, SSE, our
formatting) runs under the same GIL. As SGLang runs its HTTP/tokenizer front end and its
scheduler in separate processes, `serve` starts the real `Engine` in a child process
(spawned) and talks to it through an `EngineProcess`, which has the engine's surface.

The wire is one duplex pipe of pickled messages:
- server -> engine: ("submit", request ids, Prompts, SamplingParams, owner), ("cancel", request
  id), ("call", call id, "stats" | "clear_cache"), ("shutdown",);
- engine -> server: lists. The engine's thread only appends a request's events, as
  (request id, event) pairs, and sends them all at the next turn of its scheduler loop:
  one message per step, carrying every stream's events of that step, and a `Beat` at
  least once a second (the idle loop turns every half second). Besides them, `Facts` at
  each lifecycle change, `Reply`s to calls and `DiskRebuilt`.

The child ignores SIGINT and SIGTERM (the server drains, then sends "shutdown") and exits
when the pipe closes: the server is gone, and the GPU memory with it. When the child dies,
the server's reader sees the pipe close: every open request fails and the state turns
FAILED, which stops `serve` as any failed engine does (a model of several loads again).
A child whose loop sends no `Beat` for `step_timeout` seconds (a step that never ends, or
a process stopped) is killed: the server's side keeps the engine's watchdog, since
a stuck engine thread could not report itself.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from engine.api import (
    EngineConfig,
    EngineError,
    EngineNotReady,
    EngineStats,
    Finish,
    Lifecycle,
    Prompt,
    RequestFailed,
    SamplingParams,
    check_request,
)
from engine.engine import DISK_FLUSH_SECONDS, Engine
from engine.loader import load_tokenizer, model_id_for
from engine.platform_info import describe_platform
from engine.streams import LoopRelays, RequestStream, WaitingCount
from engine.tokenizer import ModelTokenizer
from engine.weights_digest import tokenizer_files_identity

log = logging.getLogger("radix_mlx.engine")

SPAWN = multiprocessing.get_context("spawn")  # a fork would copy the server's threads
ENGINE_PROCESS = "radix-mlx-engine"
# How long a call (stats, from a /metrics scrape) waits for the engine's answer: a scrape
# with a hung engine still answers within Prometheus' default scrape timeout (10 s).
CALL_SECONDS = 5.0
# The engine's loop says it turned at least this often (`Beat`).
BEAT_SECONDS = 1.0
# Its first word may take longer than a step: an interpreter importing MLX, on a busy
# machine, before the child can beat at all (over 2 s on 2 busy cores).
SPAWN_SECONDS = 60.0
# How long a shutdown waits for the child: the engine's own stop, then its disk writes.
STOP_SECONDS = 10.0 + DISK_FLUSH_SECONDS + 5.0
LIFECYCLE_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class Facts:
    """What the server reads of the engine, sent at each lifecycle change."""

    state: Lifecycle
    error: str | None = None
    model_id: str = ""
    context_length: int = 0
    wants_message_ends: bool = False
    kv_tokens: int = 0
    model_path: str | None = None  # where the server loads its own tokenizer from
    disk_directory: str | None = None


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: object


@dataclass(frozen=True)
class DiskRebuilt:
    """The tree has been rebuilt from the disk tier's files."""


@dataclass(frozen=True)
class Beat:
    """The engine's loop turned: it is not stuck in a step."""


BEAT = Beat()


@dataclass
class RemoteDisk:
    """The engine's disk tier as the server reads it (`engine.disk`)."""

    directory: Path
    rebuilt: threading.Event = field(default_factory=threading.Event)


# -- the child ----------------------------------------------------------------------------

class Outbox:
    """The child's end of the pipe. As its streams' relay, the engine's thread only
    appends their events, then sends them all in one message at the next turn of its
    scheduler loop (`flush`, the engine's `on_turn`): one pickle and write per step, not
    per token, and no other thread to hand the GIL to between steps. The other threads'
    messages (lifecycle, replies) are sent at once."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._events: list[tuple[str, object]] = []
        self._events_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._beaten = 0.0  # when the last `Beat` went

    def put(self, stream: RequestStream, event: object) -> None:
        """Called from the engine's thread."""
        with self._events_lock:
            self._events.append((stream.request_id, event))

    def flush(self) -> None:
        """Called from the engine's thread, at every turn of its loop."""
        batch: list[object] = []
        if self._events:
            with self._events_lock:
                batch, self._events = self._events, []
        now = time.monotonic()
        if now - self._beaten >= BEAT_SECONDS:
            self._beaten = now
            batch.append(BEAT)
        if batch:
            self.send(batch)

    def send(self, batch: list[object]) -> None:
        with self._send_lock:
            try:
                self._conn.send(batch)
            except OSError:
                _server_gone()
            except Exception:  # an event that cannot cross: fail loudly
                log.exception("the engine cannot send its events")
                logging.shutdown()
                os._exit(1)


def _server_gone() -> None:
    """The pipe closed: nobody will read the engine's answers again."""
    log.warning("the server process is gone: the engine process exits")
    logging.shutdown()
    os._exit(0)


def serve_engine(config: EngineConfig, conn: Connection,
                 on_start: Callable[[], None] | None) -> None:
    """The child's main: load and run the engine, take the server's commands until it
    says "shutdown" or goes away. `on_start` (logging) runs first."""
    # The server decides when its engines stop (a drain first); a terminal's Ctrl+C or
    # close signals its whole process group.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    if on_start is not None:
        on_start()
    log.info("engine process: %s", describe_platform())
    outbox = Outbox(conn)
    # The server watches this engine's beats instead: its own watchdog could fail the
    # requests only through the loop it watches.
    engine = Engine(replace(config, step_timeout=0), on_turn=outbox.flush)
    engine.start()
    threading.Thread(target=_report_lifecycle, args=(engine, outbox),
                     name="radix-mlx-lifecycle", daemon=True).start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _server_gone()
        match message:
            case ("submit", request_ids, prompts, params, owner):
                try:
                    engine.submit_all(prompts, params, request_ids, outbox, owner)
                except (EngineError, ValueError) as error:
                    # The server checked it already. As a RequestFailed, since not every
                    # engine error unpickles (QueueFull takes two arguments).
                    outbox.send([(request_id, RequestFailed(str(error)))
                                 for request_id in request_ids])
            case ("cancel", request_id):
                engine.cancel(request_id)
            case ("call", call_id, "stats"):
                outbox.send([Reply(call_id, engine.stats())])
            case ("call", call_id, "cached_prefix", tokens):
                outbox.send([Reply(call_id, engine.cached_prefix(tokens))])
            case ("call", call_id, "clear_cache"):
                engine.clear_cache().add_done_callback(
                    lambda done, call_id=call_id: outbox.send([Reply(call_id, done.result())]))
            case ("shutdown",):
                engine.shutdown()
                logging.shutdown()
                # Not a normal exit: the engine's parked thread must not meet interpreter
                # teardown (engine.py).
                os._exit(0)


def _report_lifecycle(engine: Engine, outbox: Outbox) -> None:
    """Tell the server each state the engine reaches; until it is ready, beat as its loop
    then does: a load (or warm-up) that goes on says so, a process stopped does not."""
    state, path, beaten = None, None, time.monotonic()
    while state not in (Lifecycle.READY, Lifecycle.FAILED):
        engine.wait_ready(LIFECYCLE_POLL_SECONDS)
        if engine.state is state and time.monotonic() - beaten >= BEAT_SECONDS:
            outbox.send([BEAT])
            beaten = time.monotonic()
        # A model path known while the weights load (a converted GGUF's folder) is told
        # at once: the server loads its tokenizer meanwhile.
        if engine.state is not state or engine.model_path != path:
            state, path = engine.state, engine.model_path
            outbox.send([Facts(
                state, engine.error, engine.model_id, engine.context_length,
                engine.wants_message_ends,
                engine.memory.kv_tokens if engine.memory is not None else 0,
                None if engine.model_path is None else str(engine.model_path),
                None if engine.disk is None else str(engine.disk.directory))])
    if engine.disk is not None:
        engine.disk.rebuilt.wait()
        outbox.send([DiskRebuilt()])


# -- the server's side --------------------------------------------------------------------

def server_tokenizer(model_path: str, chat_template: str | None) -> ModelTokenizer:
    """The server's tokenizer of a model directory, kept across the model's reloads: the
    prompt text it has tokenized (engine/token_cache.py) outlives an idle unload, so the
    first request after the reload tokenizes only what is new. Kept while the directory's
    files are the same: a folder updated in place and reloaded ran its new weights under
    its old tokenizer and chat template."""
    return _server_tokenizer(model_path, chat_template,
                             tokenizer_files_identity(Path(model_path)))


@functools.lru_cache(maxsize=32)
def _server_tokenizer(model_path: str, chat_template: str | None,
                      files: tuple[tuple[str, tuple[int, ...]], ...]) -> ModelTokenizer:
    return load_tokenizer(Path(model_path), chat_template)


class EngineProcess:
    """The `EngineClient` the server drives, served by an `Engine` in a child process. The
    server's own tokenizer (chat templates, the streams' decoders) is loaded from the
    directory the engine loaded its model from, once it is ready."""

    def __init__(self, config: EngineConfig, on_start: Callable[[], None] | None = None) -> None:
        """`on_start`: run first in the child (picklable: its logging setup)."""
        self.config = config
        self.state = Lifecycle.LOADING
        self.error: str | None = None
        self.served = False
        self.model_id = model_id_for(config.model)
        self.context_length = 0
        self.wants_message_ends = False
        self.tokenizer: ModelTokenizer | None = None
        self.model_path: Path | None = None
        self._tokenizer_path: str | None = None  # where `tokenizer` was loaded from
        self.disk: RemoteDisk | None = None
        self.process: multiprocessing.process.BaseProcess | None = None
        self._on_start = on_start
        self._kv_tokens = 0
        self._conn: Connection | None = None
        # Pickled messages for the writer thread; None: the child is gone, close the pipe.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the streams, the calls and the state's last change
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._waiting = WaitingCount(config.max_queue)
        self._relays = LoopRelays()
        self._ready = threading.Event()
        self._stopping = False
        self._closed: str | None = None  # why nothing will answer again, once so
        self._beaten = 0.0  # when the engine's loop last said it turned (`Beat`)
        self._spoken = False  # whether the child has said anything yet
        self._stuck: str | None = None  # why it was killed, if for not beating

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Start the child and the thread that reads it; returns at once."""
        self._conn, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=serve_engine, name=ENGINE_PROCESS,
                                     args=(self.config, child, self._on_start))
        self.process.start()
        self._beaten = time.monotonic()
        child.close()  # the child's death must close the pipe
        # However the server's process ends: multiprocessing's own exit handler would
        # wait forever for a child that waits for its pipe to close.
        atexit.register(self.shutdown)
        self._reader = threading.Thread(target=self._read, name="radix-mlx-engine-reader",
                                        daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="radix-mlx-engine-writer",
                                        daemon=True)
        self._writer.start()

    def wait_ready(self, timeout: float | None = None) -> Lifecycle:
        self._ready.wait(timeout)
        return self.state

    def shutdown(self) -> None:
        """Stop the engine (it cancels what runs and flushes its disk writes) and wait for
        the child to exit; kill it if it does not in time."""
        if self.process is None or self.process.exitcode is not None:
            return
        self._stopping = True
        self._send(("shutdown",))
        self.process.join(STOP_SECONDS)
        if self.process.is_alive():
            log.warning("the engine process did not stop in %.0f s: killed", STOP_SECONDS)
            self.process.kill()
            self.process.join()
        self._reader.join(STOP_SECONDS)  # then what comes after is refused (`_close`)
        self._writer.join(STOP_SECONDS)  # and the pipe is closed

    # -- requests ---------------------------------------------------------------------

    @property
    def token_limit(self) -> int:
        """As `Engine.token_limit`."""
        return min(self.context_length, self._kv_tokens)

    def submit(self, prompt: Prompt | Sequence[int], params: SamplingParams) -> RequestStream:
        """As `Engine.submit`: checked here, so refusals are immediate."""
        return self.submit_all([prompt], params)[0]

    def submit_all(self, prompts: Sequence[Prompt | Sequence[int]], params: SamplingParams,
                   owner: str | None = None) -> list[RequestStream]:
        """As `Engine.submit_all`: checked here, sent to the child in one message."""
        prompts = [p if isinstance(p, Prompt) else Prompt(list(p)) for p in prompts]
        if self.state is not Lifecycle.READY:
            raise EngineNotReady(self.error or f"the model is {self.state.value}")
        for prompt in prompts:
            check_request(prompt.tokens, params, self.context_length, self._kv_tokens)
        relay = self._relays.current()
        with self._lock:
            if self.state is not Lifecycle.READY or self._closed:  # it ended meanwhile
                raise EngineNotReady(self._closed or self.error)
            ids = [f"req-{next(self._ids)}" for _ in prompts]
            self._waiting.enter(ids)
            streams = [RequestStream(request_id, relay, self.cancel) for request_id in ids]
            for stream in streams:
                self._streams[stream.request_id] = stream
        self._send(("submit", [s.request_id for s in streams], prompts, params, owner))
        return streams

    def cancel(self, request_id: str) -> None:
        self._waiting.leave(request_id)  # its queue place is free now, as in Engine.cancel
        self._send(("cancel", request_id))

    def clear_cache(self) -> Future:
        if self.state is not Lifecycle.READY:
            done: Future = Future()
            done.set_result(0)
            return done
        return self._call("clear_cache")

    @property
    def waiting(self) -> int:
        return self._waiting.value

    def stats(self) -> EngineStats:
        """The engine's stats now (a round trip to the child); zeros unless it is ready."""
        if self.state is not Lifecycle.READY:
            return EngineStats()
        return self._call("stats").result(CALL_SECONDS)

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """A round trip to the child; 0 unless it is ready and answers (a peek is no
        reason to fail a request: its submit says what is wrong)."""
        if self.state is not Lifecycle.READY:
            return 0
        try:
            return self._call("cached_prefix", list(tokens)).result(CALL_SECONDS)
        except (EngineNotReady, TimeoutError):
            return 0

    # -- the wire ---------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        """Pickled here (what is sent is the message as it is now), written by the writer
        thread: a write blocks once the pipe's buffer is full, as it is soon when the child
        reads nothing (a process stopped, until step_timeout kills it), and written on the
        server's event loop, it froze every model's requests until then."""
        self._outbox.put(ForkingPickler.dumps(message))

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(message)
            except (OSError, ValueError):
                pass  # the child is gone: the reader fails what was open
        # Closed here, by the one thread that writes to it: closed by the reader, a
        # write under way could go to another file given the descriptor's number since.
        self._conn.close()

    def _call(self, name: str, *arguments: object) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(EngineNotReady(self._closed))
                return future
            call_id = next(self._ids)
            self._calls[call_id] = future
        self._send(("call", call_id, name, *arguments))
        return future

    def _read(self) -> None:
        self._preload_tokenizer(Path(self.config.model).expanduser())
        while True:
            try:
                if not self._conn.poll(BEAT_SECONDS):
                    self._check_beating()
                    continue
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            for item in batch:
                if isinstance(item, tuple):
                    self._deliver(*item)
                elif isinstance(item, Beat):
                    self._beaten = time.monotonic()
                elif isinstance(item, Reply):
                    with self._lock:
                        future = self._calls.pop(item.call_id, None)
                    if future is not None:
                        future.set_result(item.value)
                elif isinstance(item, Facts):
                    self._beaten, self._spoken = time.monotonic(), True
                    self._learn(item)
                elif isinstance(item, DiskRebuilt) and self.disk is not None:
                    self.disk.rebuilt.set()
            self._check_beating()
        if self._stopping:  # what the child did not answer before it stopped
            self._close("the engine stopped")
        else:
            self._lost()
        # The child is gone. The exit hook held this object, and with it the pipe and the
        # process's handles, for as long as the server runs: 3 descriptors a load, which a
        # model unloaded when idle (or crashing) runs out of in weeks.
        atexit.unregister(self.shutdown)
        self._outbox.put(None)

    def _check_beating(self) -> None:
        """Kill the child if it has not beaten for `step_timeout` seconds: a step that
        never ends, or a process stopped, loading or serving (a load that hung kept its
        model `loading` for good, every request for it waiting out `load_timeout`). The
        pipe then closes, and `_lost` fails what was open with this reason."""
        timeout = self.config.step_timeout
        limit = timeout if self._spoken else max(timeout, SPAWN_SECONDS)
        if (not timeout or self.state is Lifecycle.FAILED or self._stopping
                or self._stuck is not None or time.monotonic() - self._beaten <= limit):
            return
        if not self._spoken:
            self._stuck = f"the engine's process did not start in {limit:g} s and was killed"
        else:
            what = ("finished no scheduler step" if self.state is Lifecycle.READY
                    else "stopped answering while it loaded its model")
            self._stuck = (f"the engine is stuck: its process {what} in {timeout:g} s "
                           "(step_timeout) and was killed")
        log.error("%s", self._stuck)
        self.process.kill()

    def _preload_tokenizer(self, path: Path) -> None:
        """Load the tokenizer of a local model directory while the engine loads the model
        (which takes longer): the server is ready as soon as the engine is."""
        if path.is_dir() and str(path) != self._tokenizer_path:
            try:
                self.tokenizer = server_tokenizer(str(path), self.config.chat_template)
                self._tokenizer_path = str(path)
            except Exception:  # loaded again, and reported, once ready
                log.debug("tokenizer preload failed", exc_info=True)

    def _deliver(self, request_id: str, event: object) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                return
            self._waiting.leave(request_id)  # it has started, or ended
            if isinstance(event, (Finish, Exception)):
                del self._streams[request_id]
        stream.push(event)

    def _learn(self, facts: Facts) -> None:
        if facts.state is Lifecycle.LOADING and facts.model_path is not None:
            self._preload_tokenizer(Path(facts.model_path))
        if facts.state is Lifecycle.READY:
            try:
                if facts.model_path != self._tokenizer_path:
                    self.tokenizer = server_tokenizer(facts.model_path,
                                                      self.config.chat_template)
            except Exception as error:  # reported as the load's failure
                log.exception("the server could not load the tokenizer")
                self.error = f"the tokenizer: {type(error).__name__}: {error}"
                self.state = Lifecycle.FAILED
                self._ready.set()
                return
            self.model_id, self.context_length = facts.model_id, facts.context_length
            self.model_path = Path(facts.model_path) if facts.model_path else None
            self.wants_message_ends, self._kv_tokens = facts.wants_message_ends, facts.kv_tokens
            if facts.disk_directory is not None:
                self.disk = RemoteDisk(Path(facts.disk_directory))
            self.served = True
        self.error = facts.error
        self.state = facts.state
        if facts.state in (Lifecycle.READY, Lifecycle.FAILED):
            self._ready.set()

    def _lost(self) -> None:
        """The child died: fail everything open, and the engine."""
        self.process.join(5.0)
        code = self.process.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}")
        reason = self._stuck or f"the engine process died ({how})"
        if self._stuck is None:
            log.error("%s", reason)
        self._close(reason, failed=True)
        self._ready.set()

    def _close(self, reason: str, failed: bool = False) -> None:
        """Nothing will answer again: fail what is open, and refuse what comes after."""
        with self._lock:
            self._closed = reason
            if failed:
                self.error = reason
                self.state = Lifecycle.FAILED
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        for stream in streams.values():
            stream.push(RequestFailed(reason))
        for future in calls.values():
            future.set_exception(EngineNotReady(reason))
