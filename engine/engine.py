"""The engine: lifecycle, submit/cancel and stats for asyncio callers.

Everything MLX happens in one worker thread (see scheduler.py). Callers on an asyncio
loop submit requests through a thread-safe inbox and read events from a `RequestStream`
that the worker feeds through its loop's `LoopRelay` (one wake-up of the loop per engine
step, not per token; streams.py). The types callers see are in api.py, which imports no
MLX; `Engine` keeps its `EngineClient` contract.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.admission import SchedulerLimits, tokens_reserved
from engine.api import (
    DiskStats,
    EngineConfig,
    EngineNotReady,
    EngineStats,
    Lifecycle,
    Prompt,
    Readout,
    SamplingParams,
    SchedulerCounters,
    Unsupported,
    check_images,
    check_request,
)
from engine.constraints import json_object
from engine.disk_store import DiskStore, model_fingerprint
from engine.distributed import RankGroup, memory_domain, one_gpu_would_be_faster
from engine.draft_model import DraftModel, DraftModelError
from engine.files import default_disk_budget
from engine.grammar_check import GRAMMAR_THREAD_STACK_BYTES
from engine.kv_quant import KVQuantization, cached_bytes_per_token, kv_quantization
from engine.loader import LoadedModel, failed_load, load_model, model_id_for
from engine.memory import CPU_MEMORY_FRACTION, MemoryPlan, describe, headroom, plan_memory
from engine.mlx_lm_internals import kv_bytes_per_token, kv_layout, supports_segments
from engine.model_source import resolve_model
from engine.platform_info import apply_mlx_env_defaults
from engine.scheduler import (
    CPU_PREFILL_CHUNK,
    GPU_PREFILL_CHUNK,
    Cancel,
    ClearCache,
    Scheduler,
    Stop,
    Submit,
    SubmitAll,
)
from engine.streams import LoopRelays, Relay, RequestStream, WaitingCount
from engine.tokenizer import ModelTokenizer
from engine.weights_digest import model_files_identity

log = logging.getLogger("radix_mlx.engine")

# What the disk writer may hold in memory, waiting for the disk: this share of the memory
# budget, within these bounds.
DISK_QUEUE_FRACTION = 0.25
DISK_QUEUE_BYTES = (64 * 2**20, 2 * 2**30)
# How long a stop waits for the disk writer to finish what is queued.
DISK_FLUSH_SECONDS = 10.0
WARMUP_PROMPT_TOKENS = 48
ENGINE_THREAD = "radix-mlx-engine"  # the worker's name, as profilers show it


def device_memory_bytes() -> int:
    """What one process that has the device to itself plans for: the recommended working
    set on a Mac, else CPU_MEMORY_FRACTION of the device's (a CUDA GPU's) or the host's
    memory."""
    info = mx.device_info()
    # MLX names a CUDA GPU's memory `total_memory` (Metal's is `memory_size`); without it
    # an H100 server planned for 0.9 of the host's 126 GiB of RAM, not its 80 GB.
    device = info.get("memory_size") or info.get("total_memory")
    return info.get("max_recommended_working_set_size") or int(
        CPU_MEMORY_FRACTION * (device or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")))


def _verify_phases(prompt: list[int]) -> dict[str, list[tuple[list[int], SamplingParams]]]:
    """Warm-up phases for speculative decoding's verify steps (generator.py `_verify`): an
    answer, then its prompt three times at once drafting from the tree (greedy, with
    logprobs, sampled) beside a row that drafts nothing, so verifies of several widths keep
    tokens, roll the rest back and pad rows. On CUDA their kernels are ones decoding never
    meets: 16 streams meeting them in a fresh server decoded at 0.06x of no speculation."""
    answer = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    drafting = [replace(answer, speculation="on"),
                replace(answer, speculation="on", logprobs=2),
                replace(answer, speculation="on", temperature=0.05, seed=0)]
    return {"answer": [(prompt, answer)],
            "verify": [(prompt, params) for params in drafting] + [(prompt[1:], answer)]}


def _read_phases(instruction: list[int], vocab: int, hidden_states: bool
                 ) -> dict[str, list[tuple[list[int], SamplingParams]]]:
    """Warm-up phases for prompts read together over a cached instruction (classify,
    rerank, a decoder's embeddings: `Scheduler._read`): the list's first prompt computes
    the instruction while the others wait, then lists of the same shape are read again,
    with the next tokens' logprobs and, where the model gives them (`hidden_states`),
    with hidden states, the last of each twice alike.
    On a GPU a read of a shape seen before replays a trace (compiled_read.py), whose
    fused kernels compile when it is first traced: without these phases, a server's first
    repeated classify list compiled them (a benchmark's first round on a fresh H200 had
    one list wait 20 s, which those compiles were taken to be)."""
    prompts = [instruction + [(instruction[n] + 5 * t) % vocab for t in range(8)]
               for n in range(4)]

    def read(**wanted) -> list[tuple[list[int], SamplingParams]]:
        readout = Readout(cached_prefix=len(instruction), **wanted)
        return [(tokens, SamplingParams(max_tokens=0, temperature=0.0, readout=readout))
                for tokens in prompts]

    logprobs = read(top_logprobs=2, token_ids=(1, 2))
    phases = {"read": logprobs, "read again": logprobs, "read traced": logprobs}
    if hidden_states:
        hidden = read(hidden=True)
        phases |= {"read hidden": hidden, "read hidden traced": hidden}
    return phases


class Engine:
    """The engine in this process, an `EngineClient` (api.py). With a tensor-parallel
    `group` (distributed.py), this process is one rank: rank 0's engine takes requests;
    the others' serve nobody and run the same steps."""

    def __init__(self, config: EngineConfig, group: RankGroup | None = None,
                 on_turn: Callable[[], None] = lambda: None) -> None:
        """`on_turn`: called by the worker at every turn of its loop, after the previous
        step (where a relay that gathers events sends them on: engine/process.py)."""
        apply_mlx_env_defaults()
        self.config = config
        self.group = group
        self.state = Lifecycle.LOADING
        self.error: str | None = None
        self.model_id = model_id_for(config.model)
        self.context_length = 0
        # Whether `submit` makes use of `Prompt.message_ends`: the model's cache is reused
        # only as whole-state snapshots, so a prompt's messages are shared only where one
        # was taken. Known once loaded.
        self.wants_message_ends = False
        self.memory: MemoryPlan | None = None
        self.tokenizer: ModelTokenizer | None = None
        self.model_path: Path | None = None  # the local directory it was loaded from
        self._loaded: LoadedModel | None = None
        self._scheduler: Scheduler | None = None
        self.disk: DiskStore | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._ids = itertools.count()
        self._waiting = WaitingCount(config.max_queue)
        self._relays = LoopRelays()
        self._last_turn = 0.0  # when the scheduler last went round its loop (watchdog)
        self.served = False  # became ready: a failure now is not a failed load
        self._on_turn = on_turn

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Load, warm up and serve in the worker thread; returns at once."""
        # The worker and the threads it starts compile and run grammars: llguidance's
        # recursion needs the stack the grammar check allowed for (engine/grammar_check.py).
        threading.stack_size(GRAMMAR_THREAD_STACK_BYTES)
        self._thread = threading.Thread(target=self._main, name=ENGINE_THREAD,
                                        daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> Lifecycle:
        self._ready.wait(timeout)
        return self.state

    def wait_stopped(self) -> None:
        """Until the engine has served its last step (after `Stop`, or a lost group)."""
        self._stopped.wait()

    def _main(self) -> None:
        try:
            if self.group is not None:
                # Rank 0's settings on every rank, with this rank's own model path: ranks
                # on other hosts read their own config file and environment, and a
                # scheduler setting that differed would make their steps diverge. Here, in
                # the engine's thread like every other collective: with one made from the
                # main thread first, a lost peer left rank 0's next collective hanging
                # instead of raising (5 of 9 runs of test_a_lost_rank_fails_..., 0 of 5
                # since).
                self.config = replace(self.group.share(self.config), model=self.config.model)
            model = resolve_model(self.config.model or None, self.config.gguf_dtype)
            # A hub id's files are its cache's immutable blobs; a directory's may change,
            # which the disk tier's fingerprint must not find they did.
            files = None
            if Path(model).is_dir():  # named before the weights load (engine/process.py)
                self.model_path = Path(model)
                files = model_files_identity(self.model_path)
            loaded = load_model(model, self.group, self.config.chat_template)
            self._loaded = loaded
            self.model_id, self.tokenizer = loaded.model_id, loaded.tokenizer
            self.model_path = loaded.path
            self.context_length = min(loaded.context_length,
                                      self.config.context_length or loaded.context_length)
            self.state = Lifecycle.WARMING_UP
            quantization = self._kv_quantization(loaded)
            draft_model = self._draft_model(loaded)
            self.memory = self._plan_memory(loaded, quantization,
                                            draft_model.weight_bytes if draft_model else 0)
            if self.group is not None:  # one plan, so every rank evicts alike
                self.memory = self.group.share(self.memory)
                warning = one_gpu_would_be_faster(
                    loaded.weight_bytes, self.group.size, device_memory_bytes(),
                    cuda=mx.default_device() == mx.gpu and mx.cuda.is_available())
                if warning and self.group.leader:
                    log.warning("%s", warning)
            log.info("%s", describe(self.memory))
            self._scheduler = Scheduler(loaded, SchedulerLimits(
                max_batch_size=self.config.max_batch_size,
                prefill_batch_size=self.config.prefill_batch_size,
                prefill_chunk_tokens=self.config.prefill_chunk_tokens,
                prefill_stall_ratio=self.config.prefill_stall_ratio,
                prefill_stall_floor=self.config.prefill_stall_floor_seconds,
                max_tokens_in_flight=min(self.config.max_tokens_in_flight,
                                         self.memory.kv_tokens),
                # A budget of less than a token is none: the tree then says a miss is
                # its being off (RadixTree.explain_miss).
                cache_bytes=self.memory.cache_bytes if self.memory.cached_tokens else 0,
            ), self.group, self.config.speculation, quantization, draft_model)
            self.wants_message_ends = not self._scheduler.kv.segments
            if self._warms_up():
                self._warm_up()
            self._start_disk_tier(loaded, files)
            # What is loaded by now lives as long as the process: frozen, a full collection
            # no longer walks it. On a 2-core CPU that walk took 150-190 ms (~380k objects:
            # the libraries, the tokenizer, the model), a pause every running stream felt.
            gc.collect()
            gc.freeze()
        except Exception as error:  # noqa: BLE001 - failed_load logs it
            self.error = failed_load(error)
            self.state = Lifecycle.FAILED
            self._ready.set()
            return
        self.state = Lifecycle.READY
        self.served = True
        self._ready.set()
        log.info("ready: %s (context %d, radix budget %.0f MiB)", self.model_id,
                 self.context_length, self._scheduler.tree.capacity_bytes / 2**20)
        try:
            self._serve()
        except Exception as error:  # noqa: BLE001 - only a tensor-parallel scheduler lets one out
            self.give_up(f"the tensor-parallel group failed: {error}")
        self._stopped.set()
        # Never return: when this thread ends, MLX's thread-local compile cache is
        # destroyed and needs the GIL; if that races with interpreter shutdown the process
        # aborts. A daemon thread parked here is simply discarded at exit.
        threading.Event().wait()

    def _serve(self) -> None:
        """Run the scheduler; its events reach each asyncio loop with one wake-up per
        turn, and one more before a step's prompt forward, so decoded tokens do not wait
        for it (`LoopRelays.gathering`)."""
        with self._relays.gathering():
            self._last_turn = time.monotonic()
            if self.group is not None:
                timeout, name = self.config.collective_timeout, "collective_timeout"
            else:
                timeout, name = self.config.step_timeout, "step_timeout"
            if timeout:
                threading.Thread(target=self._watch, args=(timeout, name),
                                 name="radix-mlx-engine-watchdog", daemon=True).start()
            self._scheduler.run(beat=self._turned, deliver=self._relays.wake)

    def _turned(self) -> None:
        self._last_turn = time.monotonic()
        self._relays.wake()
        self._on_turn()

    def _watch(self, timeout: float, name: str) -> None:
        """A step that never ends (a device that hangs; under tensor parallelism a rank
        that hangs, or a collective that never returns, as NCCL's may not when a peer is
        gone) would hold every request forever: fail the engine instead. The idle loop
        turns every half second (rank 0 of a group sends a heartbeat then), so a turn
        longer than the timeout is a stuck one."""
        while self.state is Lifecycle.READY and not self._stopped.is_set():
            time.sleep(min(1.0, timeout / 4))
            if time.monotonic() - self._last_turn > timeout:
                reason = f"no scheduler step finished in {timeout:g} s ({name})"
                self.give_up(f"the tensor-parallel group failed: {reason}"
                              if self.group is not None else f"the engine is stuck: {reason}")
                return

    def give_up(self, reason: str) -> None:
        """The engine cannot go on (its group is broken, or a step never ends): it fails,
        every open request gets the reason, and a rank other than 0 exits (mlx.launch
        then stops the others). The server sees `failed` and stops, for its service
        manager to start it again."""
        if self.state is Lifecycle.FAILED:
            return
        self.error = reason
        self.state = Lifecycle.FAILED
        log.error("%s", self.error)
        for generation in list(self._scheduler.generations.values()):
            generation.fail(RuntimeError(self.error))
        if self.group is not None and not self.group.leader:
            logging.shutdown()
            os._exit(1)

    def _kv_quantization(self, loaded: LoadedModel) -> KVQuantization | None:
        """What `kv_bits` asks for, or a clear error for a model it cannot apply to."""
        if self.config.kv_bits is None:
            return None
        if not supports_segments(make_prompt_cache(loaded.model)):
            raise ValueError(
                f"kv_bits: {loaded.model_id} has sliding-window or recurrent layers, whose "
                "cache is kept as whole-state snapshots, and KV quantization covers plain "
                "KV caches only; serve this model without --kv-bits (in a models file: "
                "kv_bits = 0 in its table)")
        dtype, head_dims = kv_layout(loaded.model)
        return kv_quantization(self.config.kv_bits, self.config.kv_group_size, dtype,
                               head_dims)

    def _draft_model(self, loaded: LoadedModel) -> DraftModel | None:
        """The configured draft model, checked against `loaded`; none under tensor
        parallelism (every rank would draft alike, on a model that is not sharded)."""
        path = self.config.speculation.draft_model
        if not path:
            return None
        if self.group is not None:
            raise DraftModelError("a draft model does not run under tensor parallelism")
        draft = DraftModel.load(resolve_model(path, self.config.gguf_dtype), loaded)
        log.info("speculation: draft model %s (%.2f GB)", path, draft.weight_bytes / 1e9)
        return draft

    def _plan_memory(self, loaded: LoadedModel, quantization: KVQuantization | None,
                     draft_bytes: int = 0) -> MemoryPlan:
        """Plan weights (the draft model's too) + prefix cache + running KV under this
        process's limit and tell MLX
        that limit; on a Mac also keep that much wired, as mlx-lm's server does, so the
        model is not paged out between requests. A quantized server's prefix cache holds
        quantized tokens; its running KV stays in the model's dtype (kv_quant.py)."""
        limit = self.config.memory_limit_bytes or self._memory_share_bytes()
        gpu = mx.default_device() == mx.gpu
        chunk = max(self.config.prefill_chunk_tokens or 0,
                    GPU_PREFILL_CHUNK if gpu else CPU_PREFILL_CHUNK)
        per_token = kv_bytes_per_token(loaded.model)
        plan = plan_memory(
            limit_bytes=limit, weight_bytes=loaded.weight_bytes + draft_bytes,
            kv_bytes_per_token=per_token,
            cached_bytes_per_token=cached_bytes_per_token(per_token, quantization),
            headroom_bytes=headroom(chunk, loaded.vocab_size, per_token,
                                    self.config.max_batch_size
                                    * self.config.speculation.max_draft),
            cache_bytes=self.config.cache_bytes, cache_fraction=self.config.cache_fraction)
        mx.set_memory_limit(limit)
        working_set = mx.device_info().get("max_recommended_working_set_size")
        if working_set is not None:
            mx.set_wired_limit(min(limit, working_set))
        return plan

    def _memory_share_bytes(self) -> int:
        """This process's share of its device's memory: `memory_share` of it (servers
        started side by side on one device), split further among the tensor-parallel ranks
        that share the same memory; under tensor parallelism the smallest share of any
        rank, so that the one plan every rank follows fits on each."""
        share = int(device_memory_bytes() * self.config.memory_share)
        if self.group is None:
            return share
        return self.group.smallest_share(memory_domain(), share)

    def _start_disk_tier(self, loaded: LoadedModel,
                         files: dict[str, list[int]] | None) -> None:
        """Attach the disk tier (after warm-up, so nothing of it is written) and rebuild
        the tree from it in the background, then bring back into memory what memory held
        at the last stop (`DiskStore.rebuild`): the engine serves meanwhile. `files`: the
        model's files' identities before it loaded, which its fingerprint must still find."""
        config = self.config
        if config.disk_cache_bytes == 0 or config.disk_cache_dir is None:
            return
        if self.group is not None:
            # Its writes (dropped when the queue is full) and its rebuild at start run off
            # the scheduler, at each rank's own pace: the ranks' trees would diverge.
            log.warning("disk cache off: the disk tier is not kept under tensor parallelism")
            return
        directory = Path(config.disk_cache_dir).expanduser()
        try:
            budget = config.disk_cache_bytes or default_disk_budget(directory)
        except OSError as error:
            log.error("disk cache off: %s", error)
            return
        scheduler = self._scheduler
        fingerprint = model_fingerprint(
            loaded.path, loaded.model, make_prompt_cache(loaded.model), directory,
            loaded.vision.code_version if loaded.vision is not None else None)
        if files is not None and model_files_identity(loaded.path) != files:
            log.error("disk cache off: the model's files in %s changed while it loaded, so "
                      "which weights it holds is not known; restart it to cache again",
                      loaded.path)
            return
        low, high = DISK_QUEUE_BYTES
        queue_bytes = int(min(max(scheduler.tree.capacity_bytes * DISK_QUEUE_FRACTION, low),
                              high))
        try:
            self.disk = DiskStore(directory, budget, fingerprint, scheduler.kv.segments,
                                  queue_bytes, scheduler.kv.quantization, loaded.path)
        except OSError as error:  # an unusable directory costs the tier, not the server
            log.error("disk cache off: %s", error)
            return
        scheduler.attach_disk(self.disk)
        threading.Thread(target=self.disk.rebuild,
                         args=(scheduler.tree, scheduler.bring_back, scheduler.restore),
                         name="radix-mlx-disk-rebuild", daemon=True).start()
        log.info("disk cache: %s, budget %.1f GiB", self.disk.directory, budget / 2**30)

    def _warms_up(self) -> bool:
        """`EngineConfig.warm_up`, by default where kernels compile in every process: a
        GPU. On a 2-core CPU the warm-up held SmolLM2-135M's readiness back 9 s and Gemma 3
        270M's 9.4 s, and the first requests took as long without it (0.87 against 0.81 s,
        1.38 against 1.55 s), but for a first constrained one (0.5 s more, llguidance's
        copy of the tokenizer): MLX's CPU kernels are compiled ahead or kept on disk."""
        if self.config.warm_up is not None:
            return self.config.warm_up
        return mx.default_device() == mx.gpu

    def _warm_up(self) -> None:
        """Run the real paths once, so user requests do not pay for kernel compilation
        (on CUDA each kernel MLX meets the first time compiles for seconds, and every
        running stream waits for it): a prefill, cache hits that join a running batch
        (one row, then two, then three) and rows leaving it in turn, the second one under
        a grammar (which also converts the tokenizer for the grammar engine); then
        prompts of different lengths prefilled in one padded forward, sampled with the
        usual filters, with logprobs, and under penalties, leaving the batch in turn;
        speculative decoding's verify steps (`_verify_phases`); prompts read together
        (`_read_phases`); then forget it all."""
        scheduler = self._scheduler
        vocab = self._loaded.vocab_size
        prompt = [t % vocab for t in range(1, WARMUP_PROMPT_TOKENS + 1)]
        hits = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                               constraint=json_object() if n == 1 else None)
                for n, max_tokens in enumerate((8, 4, 2))]
        other = [(7 * t) % vocab for t in range(1, WARMUP_PROMPT_TOKENS + 1)]
        # Rows that start together and leave one by one (a batch keeping two rows, then one).
        padded = [SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, top_k=20,
                                 min_p=0.05, seed=0, ignore_eos=True),
                  SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, ignore_eos=True),
                  SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.1,
                                 presence_penalty=0.5, logit_bias={1: 1.0}, ignore_eos=True)]
        phases = {"hit": [(prompt + prompt[:4 * n], p) for n, p in enumerate(hits)],
                  "padded": [(other[n:], p) for n, p in enumerate(padded)]}
        if scheduler.kv.segments:  # a cache that rolls back can verify drafts
            phases |= _verify_phases([(11 * t) % vocab for t in range(1, WARMUP_PROMPT_TOKENS)])
        phases |= _read_phases([(13 * t) % vocab for t in range(1, WARMUP_PROMPT_TOKENS)], vocab,
                               scheduler.generator.hidden.available)
        configured = scheduler.speculation
        # Drafts from the tree, whatever the server's sources: the first phase's answer,
        # repeated, is a draft a random model can keep.
        scheduler.speculation = replace(configured, sources=("tree",))
        for name, prompts in phases.items():
            for n, (tokens, params) in enumerate(prompts):
                generation = scheduler.new_generation(f"warmup-{name}-{n}", tokens, params,
                                                      lambda event: None)
                scheduler.inbox.put(Submit(generation))
            scheduler.run(until_idle=True)
        scheduler.speculation = configured
        scheduler.tree.clear()
        scheduler.tree.departures.forget()  # no request saw what warming up cached
        scheduler.counters = scheduler.generator.counters = SchedulerCounters()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Cancel everything and stop the worker."""
        if self._scheduler is not None and self.state is Lifecycle.READY:
            self._scheduler.post(Stop())
            self._stopped.wait(timeout)
            if self.disk is not None:
                self.disk.keep_departures(self._scheduler.tree.departures_at_stop())
                self.disk.keep_in_memory(self._scheduler.tree.memory_keys())
        if self.disk is not None and not self.disk.close(DISK_FLUSH_SECONDS):
            log.warning("disk cache: stopped with writes still queued")

    # -- requests ---------------------------------------------------------------------

    @property
    def token_limit(self) -> int:
        """The most prompt + max_tokens one request may have (`check_request`): the context
        window, or the KV of fewer tokens where that is all the memory plan holds."""
        if self.memory is None:  # not loaded yet
            return self.context_length
        return min(self.context_length, self.memory.kv_tokens)

    def submit(self, prompt: Prompt | Sequence[int], params: SamplingParams,
               request_id: str | None = None, relay: Relay | None = None) -> RequestStream:
        """Queue a generation of `prompt` (token ids, or a `Prompt` that says where its
        messages end); its events go through `relay`, by default the running asyncio
        loop's (then it must be called from one). `request_id`: the caller's, unique."""
        return self.submit_all([prompt], params, [request_id], relay)[0]

    def submit_all(self, prompts: Sequence[Prompt | Sequence[int]], params: SamplingParams,
                   request_ids: Sequence[str | None] | None = None,
                   relay: Relay | None = None, owner: str | None = None
                   ) -> list[RequestStream]:
        """`submit` for each of `prompts`, with the same `params`, handed to the worker
        together: a list of readouts is then read in one forward (`Scheduler._read`).
        Every prompt is checked before any is queued: one refused refuses them all.
        `owner`: see `EngineClient.submit_all`."""
        prompts = [p if isinstance(p, Prompt) else Prompt(list(p)) for p in prompts]
        if self.state is not Lifecycle.READY:
            raise EngineNotReady(self.error or f"the model is {self.state.value}")
        readout = params.readout
        if readout is not None and readout.hidden and not self._scheduler.generator.hidden.available:
            raise Unsupported(f"the model {self.model_id} has no hidden states to embed with")
        for prompt in prompts:
            check_request(prompt.tokens, params, self.context_length, self.memory.kv_tokens)
            check_images(prompt, self._loaded.vision is not None, self.model_id)
        relay = relay or self._relays.current()
        ids = [request_id or f"req-{next(self._ids)}"
               for request_id in request_ids or [None] * len(prompts)]
        self._waiting.enter(ids)
        owner = owner or ids[0]
        streams, generations = [], []
        for prompt, request_id in zip(prompts, ids):
            if self.group is not None and not params.greedy and params.seed is None:
                # Every rank samples alike only from one seed; rank 0 picks it.
                chosen = replace(params, seed=secrets.randbits(63))
            else:
                chosen = params
            stream = RequestStream(request_id, relay, self.cancel)
            streams.append(stream)
            generations.append(self._scheduler.new_generation(
                stream.request_id, list(prompt.tokens), chosen, stream.push,
                on_dequeue=partial(self._waiting.leave, request_id),
                message_ends=prompt.message_ends,
                images=prompt.images, owner=owner))
        if self.group is not None:  # the ranks share single submits (scheduler.to_remote)
            messages = [Submit(generation) for generation in generations]
        else:
            messages = [SubmitAll(tuple(generations))]
        if not all(self._scheduler.post(message) for message in messages):
            for generation in generations:  # those posted end cancelled as the loop stops
                generation.dequeue()
            raise EngineNotReady("the engine stopped")
        return streams

    def cancel(self, request_id: str) -> None:
        """End a request early: its stream ends with a "cancelled" Finish within a step
        (nothing happens if it has ended already), and its queue place is free now. Safe
        from any thread."""
        self._waiting.leave(request_id)
        if self._scheduler is not None:
            self._scheduler.post(Cancel(request_id))

    def clear_cache(self) -> Future:
        """Drop every cached prefix nothing is using, from memory and disk; the future
        gets the memory bytes freed. Safe from any thread."""
        done: Future = Future()
        if self._scheduler is None or self.state is not Lifecycle.READY:
            done.set_result(0)
        elif not self._scheduler.post(ClearCache(done)):
            done.set_exception(EngineNotReady("the engine stopped"))
        return done

    @property
    def waiting(self) -> int:
        return self._waiting.value

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Safe from any thread: the tree's own lock, held for one walk down it (as the
        scheduler peeks for its queue's order), is all the engine's thread shares."""
        scheduler = self._scheduler
        if scheduler is None or self.state is not Lifecycle.READY:
            return 0
        return scheduler.tree.peek(tokens[:-1])

    def stats(self) -> EngineStats:
        scheduler = self._scheduler
        if scheduler is None:
            return EngineStats()
        # A copy taken at once: the engine's thread adds and removes generations meanwhile.
        running = list(scheduler.running.values())
        background = sum(g.background for g in running)
        return EngineStats(
            waiting=self._waiting.value, running=len(running) - background,
            background=background,
            active_memory_bytes=mx.get_active_memory(),
            memory_limit_bytes=self.memory.limit_bytes,
            weight_bytes=self.memory.weight_bytes,
            kv_token_capacity=self.memory.kv_tokens,
            tokens_in_flight=sum(tokens_reserved(g, scheduler.limits) for g in running),
            counters=replace(scheduler.counters), tree=scheduler.tree.stats(),
            disk=replace(self.disk.stats) if self.disk is not None else DiskStats(),
        )
