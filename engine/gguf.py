"""GGUF files (llama.cpp's one-file format) as models.

A GGUF holds the config, weights, tokenizer and chat template of a model. We translate
it once into the mlx-lm model directory it describes (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), cached per file and dtype, so the rest of the
engine loads it like any other model and the second start is instant.

- Config: llama.cpp's `<arch>.*` keys mapped onto mlx-lm's config of the same family
  (llama, qwen2, qwen3, gemma3 with its sliding-window layers).
  llama.cpp permutes the Q/K rows of llama-family files for interleaved RoPE; instead
  of undoing it we set `rope_traditional` (interleaved), which gives the same scores.
- Weights: `mx.load` reads a file whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 as MLX
  arrays, the quantized ones already in MLX's affine format. Any other type (K-quants,
  BF16, IQ) is dequantized by the `gguf` package. Then `dtype` decides: a float dtype
  dequantizes everything; "native" keeps MLX-native quantization as it is and
  re-quantizes the others with MLX at (at least) their own bit width.
- Tokenizer: a `tokenizers` byte-level BPE from the file's tokens and merges, split the
  way llama.cpp splits for the file's `tokenizer.ggml.pre`, its control tokens special;
  a SentencePiece vocabulary (Gemma, Mistral-style llama) through transformers' GGUF
  tokenizer converter.
- Chat template: the file's, or for a file without one a known template of its family
  (`engine/chat_templates.py`), whose end-of-turn token then also ends a reply.

A file that is not GGUF, is truncated, or describes something we cannot run raises
`GGUFError` with a one-line reason, before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.chat_templates import KnownTemplate, known_template
from engine.files import cache_dir, publish_directory

if TYPE_CHECKING:
    from gguf import ReaderTensor

log = logging.getLogger("radix_mlx.engine")

DTYPES = ("auto", "native", "float32", "float16", "bfloat16")
# Bump when the output of `convert` changes, so cached conversions are redone.
CONVERTER_VERSION = 3
MAGIC = b"GGUF"
GROUP_SIZE = 32  # llama.cpp's block size, and what mx.load gives its quantized types

# Tensor types by their names in the `gguf` package's GGMLQuantizationType.
# What mx.load reads without error, and the MLX (bits) its quantized types become.
MLX_NATIVE_BITS = {"F32": None, "F16": None, "Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
FILE_FLOAT_DTYPES = {"F16": mx.float16, "BF16": mx.bfloat16}
# Below 4 bits MLX's per-group affine format loses more than llama.cpp's K-quant super
# blocks do, so a re-quantized tensor never gets fewer than 4 bits.
REQUANTIZE_BITS = {2: 4, 3: 4, 4: 4, 5: 5, 6: 6, 8: 8}

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DIGITS_THEN_GPT2 = (r"\p{N}", GPT2_SPLIT)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "phi-2", "olmo"), (GPT2_SPLIT,)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"),
                    (LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (QWEN2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), DIGITS_THEN_GPT2),
}
# llama.cpp applies merges to whole pre-tokens that are in the vocabulary first.
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

# GGUF tensor name (after `blk.N.`) -> mlx-lm name (after `model.layers.N.`).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture maps onto an mlx-lm model."""

    model_type: str
    # llama.cpp permutes llama's Q/K rows for interleaved RoPE; interleaved (traditional)
    # RoPE on the permuted rows gives the same attention scores as undoing it.
    rope_traditional: bool = False
    # Gemma computes x * (1 + w) in its norms; llama.cpp's converter stores 1 + w.
    norm_offset: float = 0.0
    layer_tensors: dict[str, str] = field(default_factory=lambda: LAYER_TENSORS)


ARCHITECTURES = {
    "llama": Architecture("llama", rope_traditional=True),
    "qwen2": Architecture("qwen2"),
    "qwen3": Architecture("qwen3"),
    "gemma3": Architecture("gemma3_text", norm_offset=1.0, layer_tensors={
        **LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm"}),
}
# llama.cpp's fixed Gemma 3 settings (llama-model.cpp): every 6th layer is global, the
# sliding ones use RoPE base 10000, and the 62-layer 27B scales queries by hidden/heads.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


class GGUFError(ValueError):
    """A GGUF file we cannot serve; the message is one line naming the cause."""


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[ReaderTensor]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def arch(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def mapping(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @property
    def fallback_template(self) -> KnownTemplate | None:
        """The known template used for a file without a chat template; None: it has one."""
        if "tokenizer.chat_template" in self.metadata:
            return None
        return known_template(self.metadata["tokenizer.ggml.tokens"])

    def mlx_name(self, name: str) -> str | None:
        """The mlx-lm name of a GGUF tensor; None for one this architecture does not have."""
        stem, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        if stem in GLOBAL_TENSORS:
            return f"{GLOBAL_TENSORS[stem]}.{suffix}"
        block, _, tensor = stem.partition(".")
        layer, _, tensor = tensor.partition(".")
        layer_tensors = self.mapping.layer_tensors
        if block != "blk" or not layer.isdigit() or tensor not in layer_tensors:
            return None
        return f"model.layers.{layer}.{layer_tensors[tensor]}.{suffix}"


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse and check a GGUF file: magic, structure, completeness, architecture and
    tokenizer. Raises GGUFError; mx.load (which maps the file without bounds checks)
    must only ever see a file that passed."""
    path = Path(path).expanduser()
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as error:
        raise GGUFError(f"cannot read {path}: {error.strerror}") from None
    if magic != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it does not start with {MAGIC!r})")
    # Imported here: the `gguf` package imports mistral-common's tokenizers (~0.5 s of
    # CPU), which a server of an MLX model directory, every engine process, never needs.
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError) as error:
        raise GGUFError(f"{path} is truncated or corrupt: {error}") from None
    size = path.stat().st_size
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"{path} is truncated: its tensors need {end} bytes, it has {size}")
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    gguf = GGUFFile(path, metadata, list(reader.tensors))
    _check_supported(gguf)
    return gguf


def _check_supported(gguf: GGUFFile) -> None:
    architecture = gguf.metadata.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise GGUFError(f"{gguf.path}: architecture {architecture!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    tokenizer = gguf.metadata.get("tokenizer.ggml.model")
    if tokenizer not in ("gpt2", "llama"):
        raise GGUFError(f"{gguf.path}: tokenizer model {tokenizer!r} is not supported "
                        "(supported: gpt2, a byte-level BPE; llama, a SentencePiece BPE)")
    pre = gguf.metadata.get("tokenizer.ggml.pre", "default")
    if tokenizer == "gpt2" and pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(f"{gguf.path}: pre-tokenizer {pre!r} is not supported "
                        f"(supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))})")
    for tensor in gguf.tensors:
        if gguf.mlx_name(tensor.name) is None:
            raise GGUFError(f"{gguf.path}: tensor {tensor.name!r} is not supported "
                            f"for architecture {architecture!r}")


# -- config ---------------------------------------------------------------------------


def model_config(gguf: GGUFFile) -> dict[str, Any]:
    """The mlx-lm config.json of the file's architecture."""
    heads = int(gguf.arch("attention.head_count"))
    hidden = int(gguf.arch("embedding_length"))
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "model_type": gguf.mapping.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(gguf.arch("block_count")),
        "intermediate_size": int(gguf.arch("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.arch("attention.head_count_kv", heads)),
        "head_dim": int(gguf.arch("attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32(gguf.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _float32(gguf.arch("rope.freq_base", 10000.0)),
        "rope_traditional": gguf.mapping.rope_traditional,
        "max_position_embeddings": int(gguf.arch("context_length", 4096)),
        "vocab_size": len(tokens),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in gguf.tensors),
        "attention_bias": any(t.name.endswith("attn_q.bias") for t in gguf.tensors),
        "mlp_bias": False,
        "eos_token_id": _eos_token_ids(gguf),
    }
    scaling = gguf.arch("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear",
                                  "factor": _float32(gguf.arch("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{gguf.path}: rope scaling {scaling!r} is not supported")
    bos = gguf.metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if gguf.architecture == "gemma3":
        config |= {
            "sliding_window": int(gguf.arch("attention.sliding_window")),
            "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
            "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
            "query_pre_attn_scalar": hidden // heads if config["num_hidden_layers"] == 62
            else config["head_dim"],
        }
    return config


def _float32(value: float) -> float:
    """GGUF stores float32; print the shortest decimal that is that float32 (1e-05)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _eos_token_ids(gguf: GGUFFile) -> list[int]:
    """End of sequence, and the end-of-turn/-message tokens instruct models stop at (the
    fallback template's among them: Gemma 3's file names no end of turn)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [gguf.metadata.get(f"tokenizer.ggml.{key}") for key in keys]
    template, tokens = gguf.fallback_template, gguf.metadata["tokenizer.ggml.tokens"]
    if template is not None and template.end_of_turn in tokens:
        ids.append(tokens.index(template.end_of_turn))
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


# -- tokenizer ------------------------------------------------------------------------


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The file's tokenizer, adding BOS when the file says to."""
    meta = gguf.metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    if meta["tokenizer.ggml.model"] == "llama":
        tokenizer = _sentencepiece_bpe(gguf)
    else:
        tokenizer = _byte_level_bpe(gguf)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], int(bos))])
    return tokenizer


def _byte_level_bpe(gguf: GGUFFile) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) splitting text the way llama.cpp does for the file's
    `tokenizer.ggml.pre`; control tokens special, user-defined ones added whole."""
    meta = gguf.metadata
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    pre = meta.get("tokenizer.ggml.pre", "default")
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(
        vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
        ignore_merges=pre in IGNORE_MERGES,
    ))
    splits = [pre_tokenizers.Split(Regex(split), behavior="isolated")
              for split in PRE_TOKENIZER_SPLITS[pre]]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    token_types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == CONTROL
    ])
    tokenizer.add_tokens([
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types) if kind == USER_DEFINED
    ])
    return tokenizer


def _sentencepiece_bpe(gguf: GGUFFile) -> Tokenizer:
    """A SentencePiece BPE (Llama 2, Mistral, Gemma), built by transformers' GGUF tokenizer
    converter, which knows each family's quirks (Gemma's merge order and respelled
    spaces, Llama's prefix space); merges are derived from the scores."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
        )
    except ImportError:
        raise GGUFError(f"{gguf.path}: a SentencePiece tokenizer needs the GGUF tokenizer "
                        "converter of transformers 5") from None
    keys = {"tokenizer_type": "model", "tokens": "tokens", "scores": "scores",
            "token_type": "token_type", "merges": "merges", "pre_tokenizer_type": "pre",
            "add_prefix_space": "add_space_prefix"}
    fields = {name: gguf.metadata[f"tokenizer.ggml.{key}"] for name, key in keys.items()
              if f"tokenizer.ggml.{key}" in gguf.metadata}
    tokenizer, _ = convert_gguf_tokenizer(gguf.architecture, fields)
    return tokenizer


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """What transformers' AutoTokenizer (used by mlx_lm.load) reads next to tokenizer.json."""
    meta = gguf.metadata
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(gguf.arch("context_length", 4096)),
    }
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            config[f"{key}_token"] = tokens[token_id]
    template = gguf.fallback_template
    config["chat_template"] = (meta["tokenizer.chat_template"] if template is None
                               else template.source)
    return config


# -- weights --------------------------------------------------------------------------


def resolve_dtype(dtype: str) -> str:
    """"auto" is float32 on the CPU, where MLX's quantized kernels are slow and OpenBLAS
    is fast, and the file's own quantization ("native") on a GPU."""
    if dtype not in DTYPES:
        raise GGUFError(f"unknown dtype {dtype!r} (choose one of {', '.join(DTYPES)})")
    if dtype == "auto":
        return "native" if mx.default_device() == mx.gpu else "float32"
    return dtype


def convert_weights(gguf: GGUFFile, dtype: str) -> tuple[dict[str, mx.array], dict | None]:
    """mlx-lm-named weights, and the config's `quantization` entry (None if unquantized).

    "native" keeps every float tensor in the file's own dtype: casting SmolLM2's float32
    norms to float16 overflows its activations."""
    native = dtype == "native"
    weights: dict[str, mx.array] = {}
    layers: dict[str, dict[str, int]] = {}
    mlx_loaded = _mlx_load(gguf) if all(t.tensor_type.name in MLX_NATIVE_BITS
                                        for t in gguf.tensors) else None
    norm_offset = gguf.mapping.norm_offset
    for tensor in gguf.tensors:
        name = gguf.mlx_name(tensor.name)
        base = name.removesuffix(".weight")
        kind = tensor.tensor_type.name
        if mlx_loaded is not None and MLX_NATIVE_BITS[kind] is not None:
            bits = MLX_NATIVE_BITS[kind]
            stem = tensor.name.removesuffix(".weight")
            packed = [mlx_loaded[f"{stem}.{part}"] for part in ("weight", "scales", "biases")]
            if native:
                weights |= dict(zip((name, f"{base}.scales", f"{base}.biases"), packed))
                layers[base] = {"group_size": GROUP_SIZE, "bits": bits}
                continue
            # In float32: dequantizing with float16 scales would round every weight.
            weight, scales, biases = packed
            value = mx.dequantize(weight, scales.astype(mx.float32), biases.astype(mx.float32),
                                  group_size=GROUP_SIZE, bits=bits)
        elif mlx_loaded is not None:
            value = mlx_loaded[tensor.name]
        else:
            value = mx.array(_dequantized(tensor))
        if norm_offset and tensor.name.endswith("norm.weight"):
            value = value - norm_offset
        if not native:
            weights[name] = value.astype(getattr(mx, dtype))
        elif kind in FLOAT_TYPES:
            weights[name] = value.astype(FILE_FLOAT_DTYPES.get(kind, mx.float32))
        else:
            bits = REQUANTIZE_BITS.get(_nominal_bits(kind), 8)
            quantized = mx.quantize(value, group_size=GROUP_SIZE, bits=bits)
            weights |= dict(zip((name, f"{base}.scales", f"{base}.biases"), quantized))
            layers[base] = {"group_size": GROUP_SIZE, "bits": bits}
        mx.eval(list(weights.values())[-3:])  # bound the lazy graph per tensor
    return weights, _quantization_config(layers)


def _mlx_load(gguf: GGUFFile) -> dict[str, mx.array]:
    try:
        return mx.load(str(gguf.path))
    except (RuntimeError, ValueError) as error:
        raise GGUFError(f"{gguf.path}: MLX cannot read it: {error}") from None


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    from gguf.quants import dequantize  # see read_gguf

    try:
        return dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                        "which cannot be dequantized") from None


def _nominal_bits(kind: str) -> int:
    """Q4_K -> 4, IQ3_S -> 3, Q8_0 -> 8."""
    digits = [c for c in kind if c.isdigit()]
    return int(digits[0]) if digits else 8


def _quantization_config(layers: dict[str, dict[str, int]]) -> dict | None:
    """The most common (bits, group) as the default, with per-layer entries for the rest,
    as mlx-lm's loader reads them."""
    if not layers:
        return None
    common = Counter(tuple(v.items()) for v in layers.values()).most_common(1)[0][0]
    default = dict(common)
    return {**default, "mode": "affine",
            **{path: spec for path, spec in layers.items() if spec != default}}


# -- the model directory --------------------------------------------------------------


def convert(gguf_path: str | Path, out_dir: str | Path, dtype: str = "auto") -> Path:
    """Write the mlx-lm model directory of a GGUF file to `out_dir` (replaced), atomically."""
    dtype = resolve_dtype(dtype)
    gguf = read_gguf(gguf_path)
    out = Path(out_dir).expanduser()
    publish_directory(out, lambda staging: _write(gguf, staging, dtype), replace=True)
    return out


def _write(gguf: GGUFFile, directory: Path, dtype: str) -> None:
    config = model_config(gguf)
    weights, quantization = convert_weights(gguf, dtype)
    if quantization is not None:
        config["quantization"] = quantization
    # The file's own size is what clients list as the model's (Ollama's /api/tags): the
    # conversion's (float32 on a CPU) can be several times it.
    config["gguf"] = {"file": gguf.path.name, "bytes": gguf.path.stat().st_size,
                      "dtype": dtype, "converter_version": CONVERTER_VERSION}
    mx.save_safetensors(str(directory / "model.safetensors"), weights,
                        metadata={"format": "mlx"})
    build_tokenizer(gguf).save(str(directory / "tokenizer.json"))
    _write_json(directory / "config.json", config)
    _write_json(directory / "tokenizer_config.json", tokenizer_config(gguf))


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def cached_model_dir(gguf_path: str | Path, dtype: str = "auto") -> Path:
    """The converted directory of a GGUF file, converting it on first use.

    Cached under the user cache directory, keyed by the file's identity (resolved path,
    size, modification time) and the dtype, so a changed file is converted again. The
    directory is named after the file, which makes that the served model's id.
    """
    path = Path(gguf_path).expanduser().resolve()
    dtype = resolve_dtype(dtype)
    try:
        stat = path.stat()
    except OSError as error:
        raise GGUFError(f"cannot read {path}: {error.strerror}") from None
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{dtype}\0{CONVERTER_VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = cache_dir("gguf") / key / path.name.removesuffix(".gguf")
    if (target / "config.json").is_file():
        return target
    log.info("converting %s to an MLX model (%s) in %s", path, dtype, target)
    gguf = read_gguf(path)
    publish_directory(target, lambda staging: _write(gguf, staging, dtype), replace=False)
    return target
