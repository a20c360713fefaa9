"""`EncoderEngine`: a server's engine when its model is an encoder: a sentence-transformers
encoder (engine/bert.py), which embeds, or a cross-encoder (engine/cross_encoder.py), which
scores (query, document) pairs. It does nothing else.

An encoder attends both ways, so no prefix of one input is a prefix of another's
computation: there is no radix tree here and no scheduler, only batching. One worker
thread owns every MLX call, as in `Engine`; it runs the requests in forwards of at most
`BATCH_TOKENS` padded tokens (fewer on the CPU), each request's inputs shortest first
(little padding), the requests taking turns a forward at a time; on the CPU, each
forward's rows split over one stream per core (`cpu_streams`). It has `Engine`'s lifecycle
surface (state, start, stats, shutdown...) so the server serves it unchanged; generating
is refused (`CannotGenerate`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from engine.api import (
    EngineConfig,
    EngineNotReady,
    EngineStats,
    EventStream,
    Lifecycle,
    Prompt,
    SamplingParams,
    SchedulerCounters,
)
from engine.bert import SentenceEncoder, load_sentence_encoder
from engine.cross_encoder import CrossEncoder, load_cross_encoder
from engine.encoder_folder import is_cross_encoder, is_sentence_encoder
from engine.loader import failed_load, load_tokenizer, model_id_for
from engine.platform_info import apply_mlx_env_defaults, cpu_blas_threads
from engine.tokenizer import ModelTokenizer, trailing_specials

log = logging.getLogger("radix_mlx.engine")

# Padded tokens per forward: big enough that a GPU is busy, small enough that 64 long
# inputs do not materialize one huge attention score tensor.
BATCH_TOKENS = 16384
# On the CPU fewer (but for enough rows for each core's stream, MIN_ROWS_PER_STREAM):
# MiniLM on 2 cores embedded 240-token inputs at 5,000 tok/s in forwards of 4,096 tokens
# against 2,900 in forwards of 16,384 (its attention scores outgrow the caches), and a
# word sent meanwhile waited for a forward of 0.8 s instead of 5.
CPU_BATCH_TOKENS = 4096
BATCH_ROWS = 256
# MLX's CPU backend runs an elementwise op (GELU, layer norm, softmax) on one thread, and
# only its matrix products (OpenBLAS) on every core: on 2 cores that single-threaded part
# was a third of MiniLM's forward. So a forward's rows split over one stream per core,
# each multiplying on one BLAS thread (for that forward only: the process's other MLX work
# keeps its threads), and every part of it runs on every core: 64 sentences of 26 tokens
# took 266 ms where one stream took 336. Fewer rows than this a stream are not worth a
# stream's own matrix products.
MIN_ROWS_PER_STREAM = 8


class CannotGenerate(EngineNotReady):
    """The served model is an encoder: it embeds or scores, and generates nothing."""


def is_encoder_model(path_or_repo: str) -> bool:
    """Whether `path_or_repo` is a local sentence-transformers encoder or cross-encoder
    folder."""
    path = Path(path_or_repo).expanduser()
    return path.is_dir() and (is_cross_encoder(path) or is_sentence_encoder(path))


@dataclass
class EncodeJob:
    """Inputs for one forward's rows: token ids and, for a cross-encoder's pairs, each
    token's type (0: the query's, 1: the document's)."""

    inputs: list[list[int]]
    token_types: list[list[int]] | None = None
    done: Future = field(default_factory=Future)


class _Progress:
    """A job being computed: its rows in the order they go (shortest first, so a forward
    pads little) and the outputs of those computed."""

    def __init__(self, job: EncodeJob) -> None:
        self.job = job
        self._order = sorted(range(len(job.inputs)), key=lambda i: len(job.inputs[i]))
        self._taken = 0
        self.outputs: list[np.ndarray | None] = [None] * len(job.inputs)

    @property
    def left(self) -> bool:
        return self._taken < len(self._order)

    @property
    def next_row(self) -> int:
        return self._order[self._taken]

    def take(self) -> int:
        self._taken += 1
        return self._order[self._taken - 1]


class EncoderEngine:
    tokenizer = None  # nothing to chat with: the routes that need one answer 400
    disk = None
    wants_message_ends = False

    def __init__(self, config: EngineConfig) -> None:
        apply_mlx_env_defaults()
        self.config = config
        self.state = Lifecycle.LOADING
        self.error: str | None = None
        self.served = False
        self.model_id = model_id_for(config.model)
        self.model_path = Path(config.model).expanduser()
        self.context_length = 0
        self.dimensions = 0
        self.matryoshka: Sequence[int] | None = None
        self.vocab_size = 0
        self.weight_bytes = 0
        self.trailing_specials = 0  # after a text's own tokens ([SEP]): trailing_specials
        self._encoder: SentenceEncoder | CrossEncoder | None = None
        self._tokenizer: Tokenizer | None = None
        self._streams: list[mx.Stream] = []
        self._on_cpu = False
        self._jobs: queue.SimpleQueue[EncodeJob | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._counters = SchedulerCounters()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        ENCODER_THREADS.run(self._main)

    def wait_ready(self, timeout: float | None = None) -> Lifecycle:
        self._ready.wait(timeout)
        return self.state

    def wait_stopped(self) -> None:
        self._stopped.wait()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        if self.state is Lifecycle.READY:
            self._jobs.put(None)
            self._stopped.wait(timeout)

    def _main(self) -> None:
        try:
            self._load()
            self.state, self.served = Lifecycle.READY, True
        except Exception as error:  # noqa: BLE001 - failed_load logs it
            self.error, self.state = failed_load(error), Lifecycle.FAILED
        self._ready.set()
        if self.served:
            log.info("ready: %s (%s)", self.model_id, self._summary())
            self._serve_jobs()
        self._stopped.set()

    def _summary(self) -> str:
        if self.is_cross_encoder:
            return f"cross-encoder, pairs cut to {self.context_length} tokens"
        return f"encoder, {self.dimensions} dimensions, inputs up to {self.context_length} tokens"

    def _load(self) -> None:
        tokenizer = Tokenizer.from_file(str(self.model_path / "tokenizer.json"))
        # Its file may pad or cut every input to a fixed length; the batching here pads.
        tokenizer.no_padding()
        if is_cross_encoder(self.model_path):
            self._encoder = load_cross_encoder(self.model_path)
            # As sentence-transformers' CrossEncoder cuts a pair: the longer text first.
            tokenizer.enable_truncation(self._encoder.max_length, strategy="longest_first")
        else:
            self._encoder = load_sentence_encoder(self.model_path)
            self.dimensions = self._encoder.dimensions
            self.matryoshka = self._encoder.matryoshka
            # An input too long is refused before it gets here.
            tokenizer.no_truncation()
        self._tokenizer = tokenizer
        self.weight_bytes = sum(value.nbytes for _, value
                                in tree_flatten(self._encoder.model.parameters()))
        self._streams = cpu_streams()
        self._on_cpu = mx.default_device() == mx.cpu
        self.context_length = self._encoder.max_length
        self.vocab_size = tokenizer.get_vocab_size()
        self.trailing_specials = trailing_specials(tokenizer)
        warm_up = [[tokenizer.token_to_id("[CLS]") or 0] * 8]
        self._forward(padded(warm_up, 8), padded([[1] * 8], 8), padded([[0] * 8], 8))

    @property
    def is_cross_encoder(self) -> bool:
        """Whether the model scores (query, document) pairs rather than embeds; known once
        it is loaded."""
        return isinstance(self._encoder, CrossEncoder)

    @property
    def description(self) -> str:
        """What the model is, for the 400 of a request it cannot serve."""
        if self.is_cross_encoder:
            return ("a cross-encoder (a reranker): it serves /v1/rerank only, and has no "
                    "sentence embedding")
        return "an embedding model: it serves /v1/embeddings and /v1/rerank only"

    def _serve_jobs(self) -> None:
        """Until `shutdown`: the jobs in, one forward at a time, each job's rows taken in
        turn (`_forward_turn`), so a short request waits for one forward, not for every
        forward of the jobs that came before it (a word behind 512 inputs on a 2-core CPU
        waited 80 s). Jobs still unfinished at `shutdown` are finished first."""
        turns: deque[_Progress] = deque()
        serving = True
        while serving or turns:
            if serving:
                serving = self._take_in(turns, wait=not turns)
            for work in [work for work in turns if work.job.done.cancelled()]:
                turns.remove(work)  # its client left: what it has not computed is dropped
            if turns:
                self._forward_turn(turns)

    def _take_in(self, turns: deque[_Progress], wait: bool) -> bool:
        """Every job waiting, onto the back of `turns`, after waiting for one if `wait`;
        False once `shutdown` has asked to stop."""
        try:
            job = self._jobs.get(block=wait)
            while job is not None:
                turns.append(_Progress(job))
                job = self._jobs.get_nowait()
        except queue.Empty:
            return True
        return False

    # -- requests ---------------------------------------------------------------------

    def submit(self, prompt: Prompt | Sequence[int], params: SamplingParams) -> EventStream:
        raise CannotGenerate(f"the model {self.model_id} is {self.description}")

    def submit_all(self, prompts: Sequence[Prompt | Sequence[int]], params: SamplingParams,
                   owner: str | None = None) -> list[EventStream]:
        raise CannotGenerate(f"the model {self.model_id} is {self.description}")

    @property
    def token_limit(self) -> int:
        """An input's most tokens: nothing is generated after it."""
        return self.context_length

    def cancel(self, request_id: str) -> None:
        """Nothing to end: `submit` never opens a stream (a job ends by cancelling its
        future, `embed`)."""

    @cached_property
    def text_tokenizer(self) -> ModelTokenizer:
        """The model's tokenizer as a causal model's engine has it, for what counts or shows
        a text's tokens (/tokenize, /detokenize): loaded from the folder on the first such
        request (a tenth of a second for MiniLM's), as nothing else here needs it. Safe
        from any thread (two first requests may each load one)."""
        return load_tokenizer(self.model_path)

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with the model's special tokens; safe from any thread."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def encode_pairs(self, query: str, documents: list[str]) -> list[tuple[list[int], list[int]]]:
        """A cross-encoder's input for each (query, document): token ids and token types,
        cut to `context_length` as its reference does; safe from any thread."""
        encodings = self._tokenizer.encode_batch([(query, document) for document in documents])
        return [(encoding.ids, encoding.type_ids) for encoding in encodings]

    def embed(self, inputs: list[list[int]]) -> Future:
        """Embed each list of token ids (checked by the caller: non-empty, in the
        vocabulary, within `context_length`); the future gets a (len(inputs), dimensions)
        float32 array. Cancelling the future (the client left) drops the inputs not yet
        computed. Safe from any thread."""
        return self._submit(EncodeJob(inputs))

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> Future:
        """A cross-encoder's relevance score of each pair from `encode_pairs`; the future
        gets a (len(pairs),) float32 array. Safe from any thread."""
        job = EncodeJob([ids for ids, _ in pairs], [types for _, types in pairs])
        return self._submit(job)

    def probe(self) -> Future:
        """One small forward through the worker thread, as a health check that runs the
        model; safe from any thread."""
        return self._submit(EncodeJob([[0, 0]], [[0, 0]] if self.is_cross_encoder else None))

    def _submit(self, job: EncodeJob) -> Future:
        if self.state is not Lifecycle.READY:
            raise EngineNotReady(self.error or f"the model is {self.state.value}")
        self._jobs.put(job)
        return job.done

    def clear_cache(self) -> Future:
        done: Future = Future()
        done.set_result(0)
        return done

    def stats(self) -> EngineStats:
        return EngineStats(weight_bytes=self.weight_bytes, counters=replace(self._counters))

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        return 0  # no cache: nothing generates here

    @property
    def waiting(self) -> int:
        return 0  # nothing generates here: `submit` is refused

    def _forward_turn(self, turns: deque[_Progress]) -> None:
        """One forward of at most BATCH_ROWS rows and `_batch_tokens` padded tokens: the
        shortest rows left of the job at the front of `turns`, then, as far as they pad
        no wider, the shortest of the others'; the front job then goes to the back. A job
        whose rows are all computed gets its outputs; if the forward raises, each job with
        rows in it gets the error."""
        batch: list[tuple[_Progress, int]] = []
        width = 0
        front = turns[0]
        for work in turns:
            while work.left and len(batch) < BATCH_ROWS:
                length = len(work.job.inputs[work.next_row])
                wider = max(width, length)
                if batch and (wider * (len(batch) + 1) > self._batch_tokens(wider)
                              or work is not front and length > width):
                    break
                batch.append((work, work.take()))
                width = max(width, length)
        turns.rotate(-1)
        rows = [work.job.inputs[row] for work, row in batch]
        types = [work.job.token_types[row] for work, row in batch
                 if work.job.token_types is not None]
        started, cpu_started = time.perf_counter(), time.thread_time()
        try:
            outputs = self._forward(
                padded(rows, width), padded([[1] * len(row) for row in rows], width),
                padded(types, width) if types else None) if batch else []
        except Exception as error:
            log.exception("encoder forward failed")
            for work in {id(work): work for work, _ in batch}.values():
                turns.remove(work)
                self._counters.requests_failed += 1
                if work.job.done.set_running_or_notify_cancel():
                    work.job.done.set_exception(error)
            return
        self._counters.prefill_tokens += sum(map(len, rows))
        self._counters.steps += 1
        self._counters.step_seconds += time.perf_counter() - started
        self._counters.step_cpu_seconds += time.thread_time() - cpu_started
        for (work, row), output in zip(batch, outputs):
            work.outputs[row] = output
        for work in [work for work in turns if not work.left]:
            turns.remove(work)
            # False for a job cancelled while its last forward ran.
            if work.job.done.set_running_or_notify_cancel():
                work.job.done.set_result(np.stack(work.outputs))
                self._counters.prompt_tokens += sum(map(len, work.job.inputs))

    def _batch_tokens(self, width: int) -> int:
        """The most padded tokens of a forward whose rows are `width` wide."""
        if not self._on_cpu:
            return BATCH_TOKENS
        rows_for_streams = MIN_ROWS_PER_STREAM * len(self._streams) * width
        return min(BATCH_TOKENS, max(CPU_BATCH_TOKENS, rows_for_streams))

    def _forward(self, ids: mx.array, attention: mx.array, types: mx.array | None
                 ) -> np.ndarray:
        """The encoder's output for one padded batch: on the CPU, its rows in parts, one
        on each core's stream, evaluated together."""
        parts = min(len(self._streams), len(ids) // MIN_ROWS_PER_STREAM)
        if parts < 2:
            return np.array(self._encoder(ids, attention, types).astype(mx.float32))
        bounds = [len(ids) * part // parts for part in range(parts + 1)]
        outputs = []
        for stream, start, end in zip(self._streams, bounds, bounds[1:]):
            with mx.stream(stream):
                part_types = None if types is None else types[start:end]
                outputs.append(self._encoder(ids[start:end], attention[start:end],
                                             part_types).astype(mx.float32))
        with cpu_blas_threads(1):
            mx.eval(outputs)
        return np.concatenate([np.array(output) for output in outputs])


class EncoderThreads:
    """The threads encoders run on, each kept for the next encoder once its own has
    stopped: an MLX stream on the CPU works only on the thread that made it, and has a
    thread of its own that MLX never ends, so every load on a new thread (a model of
    several, loaded again after each idle unload) left one thread a core behind."""

    def __init__(self) -> None:
        self._idle: queue.SimpleQueue[queue.SimpleQueue[Callable[[], None]]] = queue.SimpleQueue()

    def run(self, work: Callable[[], None]) -> None:
        """Run `work` on an idle thread, or on a new one if none is idle."""
        try:
            inbox = self._idle.get_nowait()
        except queue.Empty:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="radix-mlx-encoder",
                             daemon=True).start()
        inbox.put(work)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            inbox.get()()
            self._idle.put(inbox)


ENCODER_THREADS = EncoderThreads()
_thread_streams = threading.local()


def cpu_streams() -> list[mx.Stream]:
    """One MLX stream per core this process may run on, where MLX computes on the CPU
    (`MIN_ROWS_PER_STREAM`); none on a GPU. Made once a thread (`EncoderThreads`)."""
    if mx.default_device() != mx.cpu:
        return []
    if not hasattr(_thread_streams, "streams"):
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count())
        _thread_streams.streams = ([mx.new_stream(mx.cpu) for _ in range(cores)]
                                   if cores and cores >= 2 else [])
    return _thread_streams.streams


def padded(rows: list[list[int]], width: int) -> mx.array:
    """`rows` as one array, each filled to `width` with zeros (masked by the caller)."""
    return mx.array([row + [0] * (width - len(row)) for row in rows])
