"""`EncoderEngine`: a server's engine when its model is an encoder: a sentence-transformers
encoder (engine/bert.py), which embeds, or a cross-encoder (engine/cross_encoder.py), which
scores (query, document) pairs. It does nothing else.

An encoder attends both ways, so no prefix of one input is a prefix of another's
computation: there is no radix tree here and no scheduler, only batching. One worker
thread owns every MLX call, as in `Engine`; it takes every request waiting at once,
sorts their inputs by length (little padding) and runs them in forwards of at most
`BATCH_TOKENS` padded tokens; on the CPU, each forward's rows split over one stream per
core (`cpu_streams`). It has `Engine`'s lifecycle surface (state, start, stats,
shutdown...) so the server serves it unchanged; generating is refused (`CannotGenerate`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
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
from engine.bert import SentenceEncoder, is_sentence_encoder, load_sentence_encoder
from engine.cross_encoder import CrossEncoder, is_cross_encoder, load_cross_encoder
from engine.loader import failed_load, model_id_for
from engine.platform_info import apply_mlx_env_defaults, cpu_blas_threads

log = logging.getLogger("radix_mlx.engine")

# Padded tokens per forward: big enough that a 2-core CPU or a GPU is busy, small enough
# that 64 long inputs do not materialize one huge attention score tensor.
BATCH_TOKENS = 16384
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
        self.matryoshka: tuple[int, ...] | None = None
        self.vocab_size = 0
        self._encoder: SentenceEncoder | CrossEncoder | None = None
        self._tokenizer: Tokenizer | None = None
        self._streams: list[mx.Stream] = []
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
        self._streams = cpu_streams()
        self.context_length = self._encoder.max_length
        self.vocab_size = tokenizer.get_vocab_size()
        self._run([[tokenizer.token_to_id("[CLS]") or 0] * 8], [[0] * 8])  # compile, warm up

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
        """Until `shutdown`: every job waiting at once, in one set of forwards."""
        while (job := self._jobs.get()) is not None:
            jobs = [job]
            stopping = False
            while not stopping:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                stopping = more is None
                jobs += [more] if more is not None else []
            self._serve(jobs)
            if stopping:
                return

    # -- requests ---------------------------------------------------------------------

    def submit(self, prompt: Prompt | Sequence[int], params: SamplingParams) -> EventStream:
        raise CannotGenerate(f"the model {self.model_id} is {self.description}")

    def submit_all(self, prompts: Sequence[Prompt | Sequence[int]], params: SamplingParams
                   ) -> list[EventStream]:
        raise CannotGenerate(f"the model {self.model_id} is {self.description}")

    @property
    def token_limit(self) -> int:
        """An input's most tokens: nothing is generated after it."""
        return self.context_length

    def cancel(self, request_id: str) -> None:
        """Nothing to end: `submit` never opens a stream (a job ends by cancelling its
        future, `embed`)."""

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
        return EngineStats(counters=replace(self._counters))

    @property
    def waiting(self) -> int:
        return 0  # nothing generates here: `submit` is refused

    def _serve(self, jobs: list[EncodeJob]) -> None:
        owners = [job for job in jobs for _ in job.inputs]
        inputs = [ids for job in jobs for ids in job.inputs]
        # One engine's jobs are all of one kind: pairs for a cross-encoder, else texts.
        token_types = (None if jobs[0].token_types is None
                       else [types for job in jobs for types in job.token_types])
        try:
            outputs = self._run(inputs, token_types, lambda row: owners[row].done.cancelled())
        except Exception as error:
            log.exception("encoder forward failed")
            self._counters.requests_failed += len(jobs)
            for job in jobs:
                if job.done.set_running_or_notify_cancel():
                    job.done.set_exception(error)
            return
        start = 0
        for job in jobs:
            end = start + len(job.inputs)
            # False for a job cancelled before or during its forwards (its rows skipped).
            if job.done.set_running_or_notify_cancel():
                job.done.set_result(np.stack(outputs[start:end]))
                self._counters.prompt_tokens += sum(map(len, job.inputs))
            start = end

    def _run(self, inputs: list[list[int]], token_types: list[list[int]] | None = None,
             skipped: Callable[[int], bool] = lambda row: False) -> list[np.ndarray | None]:
        """The model's output for each of `inputs` (with its `token_types`, for a pair),
        shortest first, in forwards of at most BATCH_TOKENS padded tokens: embeddings, or
        scores, in the order given. A row `skipped` says no to when its forward comes (its
        client left) is not computed: None."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        outputs: list[np.ndarray | None] = [None] * len(inputs)
        start = 0
        while start < len(order):
            end = start + 1
            while (end < len(order) and end - start < BATCH_ROWS
                   and len(inputs[order[end]]) * (end + 1 - start) <= BATCH_TOKENS):
                end += 1
            batch = [row for row in order[start:end] if not skipped(row)]
            start = end
            if not batch:
                continue
            width = len(inputs[batch[-1]])
            ids = padded([inputs[i] for i in batch], width)
            attention = padded([[1] * len(inputs[i]) for i in batch], width)
            types = None if token_types is None else padded([token_types[i] for i in batch],
                                                            width)
            for row, output in zip(batch, self._forward(ids, attention, types)):
                outputs[row] = output
            self._counters.prefill_tokens += sum(len(inputs[i]) for i in batch)
            self._counters.steps += 1
        return outputs


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
