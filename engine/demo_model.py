"""Deterministic demo models: random float32 weights and a real byte-level BPE tokenizer.

Tests, benchmarks and a first `radix-mlx serve` need a model that `mlx_lm.load` accepts
without downloading anything. The weights are random (from a fixed seed), but every
file is a standard mlx-lm model directory, so the whole serving path runs for real.
The same (size, seed, family) always gives byte-identical files, so tests and caches can
rely on it.
"""

import importlib
import json
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.files import cache_dir, publish_directory

FAMILIES = ("llama", "gemma3_text", "qwen3_next")

# Shapes shared by every family; a family maps them onto its own config keys.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 2048,
    },
    "bench": {
        "hidden_size": 1024,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 2816,
        "vocab_size": 4096,
    },
}

BOS, EOS, PAD, IM_START, IM_END = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
)
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
# Qwen2.5-Coder's fill-in-the-middle tokens, for a demo model that has them.
FILL_IN_MIDDLE_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>",
                         "<|repo_name|>", "<|file_sep|>"]

# Small enough that a short test prompt already makes the rotating cache wrap.
SLIDING_WINDOW = 32
MAX_POSITION_EMBEDDINGS = 8192
WEIGHT_GAIN = 2.0

# ChatML, as in Qwen2.5: every literal lives in an expression and every tag trims the
# layout whitespace around it, so the output does not depend on the renderer's
# trim_blocks/lstrip_blocks settings.
CHAT_TEMPLATE = r"""
{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content %}
        {%- for part in content if part.type == 'text' %}
            {{- part.text }}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system %}
        {{- render_content(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query. ' }}
    {{- 'Function signatures:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call a function, reply with a JSON object inside <tool_call></tool_call> ' }}
    {{- 'tags: {"name": <function-name>, "arguments": <args-json-object>}<|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (loop.first and has_system) %}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) }}
        {%- for call in message.tool_calls or [] %}
            {%- set function = call.function if call.function is defined else call %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + function.name + '", "arguments": ' }}
            {%- if function.arguments is string %}
                {{- function.arguments }}
            {%- else %}
                {{- function.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def demo_model_path(size: str = "tiny", seed: int = 0) -> Path:
    """The cached llama demo model for (size, seed), built on first use.

    Concurrent callers may all build; the first rename wins and the others discard theirs.
    """
    path = cache_dir("demo-models") / f"{size}-seed{seed}"
    if not path.is_dir():
        _build(path, size, seed, "llama", replace=False)
    return path


def build_demo_model(
    path: str | Path, size: str = "tiny", seed: int = 0, family: str = "llama",
    fill_in_middle: Sequence[str] = (),
) -> Path:
    """Write a complete model directory to `path`, replacing whatever was there; its
    vocabulary also has the `fill_in_middle` tokens (a code model's, such as
    `FILL_IN_MIDDLE_TOKENS`, Qwen2.5-Coder's)."""
    path = Path(path)
    _build(path, size, seed, family, replace=True, fill_in_middle=fill_in_middle)
    return path


def _build(path: Path, size: str, seed: int, family: str, replace: bool,
           fill_in_middle: Sequence[str] = ()) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {list(FAMILIES)}")
    specials = [*SPECIAL_TOKENS, *fill_in_middle]
    publish_directory(
        path, lambda staging: _write_model(staging, size, seed, family, specials), replace)


def _write_model(directory: Path, size: str, seed: int, family: str,
                 specials: list[str]) -> None:
    tokenizer = train_tokenizer(SIZES[size]["vocab_size"], specials)
    config = model_config(family, size, tokenizer)
    weights = random_weights(config, seed)

    import mlx.core as mx

    mx.save_safetensors(
        str(directory / "model.safetensors"),
        {name: mx.array(value) for name, value in sorted(weights.items())},
        metadata={"format": "mlx"},
    )
    write_json(directory / "config.json", config)
    write_json(directory / "tokenizer_config.json", tokenizer_config(tokenizer, specials))
    write_json(
        directory / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD},
    )
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def corpus_texts() -> list[str]:
    """The tokenizer's training text, shipped inside the package, in a fixed order."""
    corpus = resources.files("engine") / "demo_corpus"
    names = sorted(entry.name for entry in corpus.iterdir() if entry.name.endswith(".txt"))
    return [(corpus / name).read_text(encoding="utf-8") for name in names]


def train_tokenizer(vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """A byte-level BPE (GPT-2 / Llama-3 style), so any UTF-8 text round-trips exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    documents = [part for text in corpus_texts() for part in text.split("\n---\n")]
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, specials: list[str] = SPECIAL_TOKENS) -> dict:
    """What transformers' AutoTokenizer (used by mlx_lm.load) reads next to tokenizer.json."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": special_tokens_decoder(tokenizer, specials),
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_decoder(tokenizer: Tokenizer, tokens: list[str]) -> dict:
    """tokenizer_config.json's `added_tokens_decoder`: each of `tokens`, special, by id."""
    return {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in tokens
    }


def model_config(family: str, size: str, tokenizer: Tokenizer) -> dict:
    """An HF-style config.json for `family` with the shape of `size`."""
    shape = dict(SIZES[size], vocab_size=tokenizer.get_vocab_size())
    common = {
        **shape,
        "model_type": family,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "bos_token_id": tokenizer.token_to_id(BOS),
        # Both ends: raw completions stop at end-of-text, chat turns at im_end.
        "eos_token_id": [tokenizer.token_to_id(EOS), tokenizer.token_to_id(IM_END)],
        "pad_token_id": tokenizer.token_to_id(PAD),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if family == "llama":
        return {**common, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    if family == "gemma3_text":
        # Every second layer is global, the others slide: make_cache mixes
        # RotatingKVCache and KVCache.
        return {
            **common,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "query_pre_attn_scalar": shape["head_dim"],
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 2,
        }
    # qwen3_next: gated-delta recurrent layers (ArraysCache) alternating with attention
    # (KVCache); dense MLPs only, since experts add nothing to cache behaviour.
    return {
        **common,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "full_attention_interval": 2,
        "linear_num_value_heads": shape["num_attention_heads"],
        "linear_num_key_heads": shape["num_key_value_heads"],
        "linear_key_head_dim": shape["head_dim"],
        "linear_value_head_dim": shape["head_dim"],
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 0,
        "shared_expert_intermediate_size": 0,
    }


def random_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Weights for mlx-lm's own module tree of `config`, from `seed` alone.

    Everything random comes from numpy (bit-stable across platforms, and no global MLX
    RNG state is touched, so building inside a running server cannot disturb sampling).
    Matrices get std 2/sqrt(fan_in): at 1/sqrt(fan_in) greedy decoding of the tiny llama
    often locked onto one token, at 2 it wanders like text should. Vectors keep mlx-lm's
    constant init (norms, biases), except the recurrent decay `A_log`, which mlx-lm draws
    at random and we redraw the same way.
    """
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return random_parameters(module.Model(module.ModelArgs.from_dict(config)), seed)


def random_parameters(model: Any, seed: int) -> dict[str, np.ndarray]:
    """`random_weights` for any MLX module tree (mlx-vlm's too): its parameter names, each
    matrix drawn from `seed` at std 2/sqrt(fan_in), biases zero, other vectors as the
    module made them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    weights = {}
    for name, value in sorted(tree_flatten(model.parameters())):
        if value.ndim >= 2:
            fan_in = math.prod(value.shape[1:])
            sample = rng.standard_normal(value.shape, dtype=np.float32)
            weights[name] = sample * np.float32(WEIGHT_GAIN / math.sqrt(fan_in))
        elif name.endswith("A_log"):
            weights[name] = np.log(rng.uniform(0, 16, value.shape)).astype(np.float32)
        elif name.endswith(".bias"):  # MLX draws them from its global RNG: not from `seed`
            weights[name] = np.zeros(value.shape, np.float32)
        else:
            weights[name] = np.array(value.astype(mx.float32))
    return weights


def drawn_parameters(model: Any, seed: int, dtype: str) -> dict[str, Any]:
    """`random_parameters` drawn by MLX on its default device, in `dtype`, for models of
    billions of parameters: numpy's float32 draw would take minutes and 4 bytes each.
    Seeds MLX's global RNG, so it is for a process of its own (a build), not a server.
    Each parameter is computed as it is drawn (the model's own lazy init never is)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    mx_dtype = getattr(mx, dtype)
    mx.random.seed(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2:
            scale = WEIGHT_GAIN / math.sqrt(math.prod(value.shape[1:]))
            value = mx.random.normal(value.shape, dtype=mx_dtype) * scale
        elif name.endswith(".bias"):
            value = mx.zeros(value.shape)
        weights[name] = value.astype(mx_dtype)
        mx.eval(weights[name])
    return weights
