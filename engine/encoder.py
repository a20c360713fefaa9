"""`EncoderEngine`: a server's engine when its model is a sentence-transformers encoder
(engine/bert.py). It embeds and does nothing else.

An encoder attends both ways, so no prefix of one input is a prefix of another's
computation: there is no radix tree here and no scheduler, only batching. One worker
thread owns every MLX call, as in `Engine`; it takes every request waiting at once,
sorts their inputs by length (little padding) and runs them in forwards of at most
`BATCH_TOKENS` padded tokens. It has `Engine`'s lifecycle surface (state, start, stats,
shutdown...) so the server serves it unchanged; generating is refused (`CannotGenerate`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
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
from engine.loader import model_id_for
from engine.platform_info import apply_mlx_env_defaults

log = logging.getLogger("radix_mlx.engine")

# Padded tokens per forward: big enough that a 2-core CPU or a GPU is busy, small enough
# that 64 long inputs do not materialize one huge attention score tensor.
BATCH_TOKENS = 16384
BATCH_ROWS = 256


class CannotGenerate(EngineNotReady):
    """The served model is an encoder: it embeds, and generates nothing."""


def is_encoder_model(path_or_repo: str) -> bool:
    """Whether `path_or_repo` is a local sentence-transformers encoder folder."""
    path = Path(path_or_repo).expanduser()
    return path.is_dir() and is_sentence_encoder(path)


@dataclass
class EmbedJob:
    inputs: list[list[int]]
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
        self._encoder: SentenceEncoder | None = None
        self._tokenizer: Tokenizer | None = None
        self._jobs: queue.SimpleQueue[EmbedJob | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._counters = SchedulerCounters()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._main, name="radix-mlx-encoder", daemon=True).start()

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
        except Exception as error:
            log.exception("model failed to load")
            self.error, self.state = f"{type(error).__name__}: {error}", Lifecycle.FAILED
        self._ready.set()
        if self.served:
            log.info("ready: %s (encoder, %d dimensions, inputs up to %d tokens)",
                     self.model_id, self.dimensions, self.context_length)
            self._serve_jobs()
        self._stopped.set()

    def _load(self) -> None:
        self._encoder = load_sentence_encoder(self.model_path)
        tokenizer = Tokenizer.from_file(str(self.model_path / "tokenizer.json"))
        # Its file may pad or cut every input to a fixed length; the batching here pads,
        # and an input too long is refused before it gets here.
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        self.context_length = self._encoder.max_length
        self.dimensions = self._encoder.dimensions
        self.matryoshka = self._encoder.matryoshka
        self.vocab_size = tokenizer.get_vocab_size()
        self._run([[tokenizer.token_to_id("[CLS]") or 0] * 8])  # compile, warm up

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
        raise CannotGenerate(f"the model {self.model_id} is an embedding model: it does "
                             "not generate text")

    @property
    def token_limit(self) -> int:
        """An input's most tokens: nothing is generated after it."""
        return self.context_length

    def cancel(self, request_id: str) -> None:
        """Nothing to end: `submit` never opens a stream."""

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with the model's special tokens; safe from any thread."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def embed(self, inputs: list[list[int]]) -> Future:
        """Embed each list of token ids (checked by the caller: non-empty, in the
        vocabulary, within `context_length`); the future gets a (len(inputs), dimensions)
        float32 array. Safe from any thread."""
        if self.state is not Lifecycle.READY:
            raise EngineNotReady(self.error or f"the model is {self.state.value}")
        job = EmbedJob(inputs)
        self._jobs.put(job)
        return job.done

    def clear_cache(self) -> Future:
        done: Future = Future()
        done.set_result(0)
        return done

    def stats(self) -> EngineStats:
        return EngineStats(counters=replace(self._counters))

    def _serve(self, jobs: list[EmbedJob]) -> None:
        try:
            vectors = self._run([ids for job in jobs for ids in job.inputs])
        except Exception as error:
            log.exception("embedding failed")
            self._counters.requests_failed += len(jobs)
            for job in jobs:
                job.done.set_exception(error)
            return
        start = 0
        for job in jobs:
            job.done.set_result(vectors[start:start + len(job.inputs)])
            start += len(job.inputs)
        self._counters.prompt_tokens += sum(len(ids) for job in jobs for ids in job.inputs)

    def _run(self, inputs: list[list[int]]) -> np.ndarray:
        """Embed `inputs`, shortest first, in forwards of at most BATCH_TOKENS padded
        tokens; rows come back in the order given."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        out = np.empty((len(inputs), self._encoder.dimensions), np.float32)
        start = 0
        while start < len(order):
            end = start + 1
            while (end < len(order) and end - start < BATCH_ROWS
                   and len(inputs[order[end]]) * (end + 1 - start) <= BATCH_TOKENS):
                end += 1
            rows = [inputs[i] for i in order[start:end]]
            width = len(rows[-1])
            ids = mx.array([row + [0] * (width - len(row)) for row in rows])
            attention = mx.array([[1] * len(row) + [0] * (width - len(row)) for row in rows])
            vectors = self._encoder(ids, attention).astype(mx.float32)
            out[order[start:end]] = np.array(vectors)
            self._counters.prefill_tokens += sum(map(len, rows))
            self._counters.steps += 1
            start = end
        return out
