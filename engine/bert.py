"""A BERT-family encoder in MLX and the sentence-transformers pipeline around it: the
Transformer module, then the model's own pooling and normalisation (`modules.json`,
`1_Pooling/config.json`), so a sentence-transformers folder embeds here as it does there.

Written here rather than taken from mlx-embeddings: that package is GPL-3.0 and pulls in
mlx-vlm and transformers>=5 for what is, for BERT, one small forward; the parameter names
below are Hugging Face's, so a `model.safetensors` loads as it is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx import nn

from engine.embedding_config import matryoshka_dimensions

# The pooling modes sentence-transformers' Pooling config can switch on, in its order.
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens",
                 "lasttoken")


# MLX's CPU backend computes `erf` and `exp` at 20-40 ns an element, so GELU over every
# intermediate activation and softmax over every attention score cost more than all of
# MiniLM's matrix products there. Written below in multiplies and adds, which `mx.compile`
# fuses into one loop, they cost 2-4 ns an element (tests check them against MLX's own).

# Abramowitz and Stegun 7.1.28: erf(x) = 1 - (1 + a1 x + ... + a6 x^6)^-16 for x >= 0,
# within 3e-7.
ERF_COEFFICIENTS = (0.0705230784, 0.0422820123, 0.0092705272, 0.0001520143, 0.0002765672,
                    0.0000430638)
# exp(y) = exp(y / 128)^128: the Taylor series to degree 10 on [-0.68, 0], then seven
# squarings, within 3e-5 relative for y in [-87, 0] (a softmax weight's error).
EXP_SQUARINGS = 7
EXP_COEFFICIENTS = tuple(1 / math.factorial(k) for k in range(11))


@partial(mx.compile, shapeless=True)
def gelu(x: mx.array) -> mx.array:
    """BERT's exact (erf) GELU: x/2 (1 + erf(x / sqrt 2))."""
    z = mx.abs(x) * (1 / math.sqrt(2))
    polynomial = 0.0
    for coefficient in reversed(ERF_COEFFICIENTS):
        polynomial = (polynomial + coefficient) * z
    power = 1.0 + polynomial
    for _ in range(4):
        power = power * power
    erf = mx.sign(x) * (1.0 - 1.0 / power)
    return 0.5 * x * (1.0 + erf)


@partial(mx.compile, shapeless=True)
def exp_nonpositive(x: mx.array) -> mx.array:
    """exp(x) for x <= 0; 0 below float32's smallest normal (about -87)."""
    y = x * (1 / 2 ** EXP_SQUARINGS)
    result = EXP_COEFFICIENTS[-1]
    for coefficient in reversed(EXP_COEFFICIENTS[:-1]):
        result = result * y + coefficient
    for _ in range(EXP_SQUARINGS):
        result = result * result
    return mx.where(x > -87.0, result, 0.0)


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis; a row that is all -inf gives zeros, not NaN."""
    peak = mx.maximum(scores.max(axis=-1, keepdims=True), -1e30)
    weights = exp_nonpositive(scores - peak)
    return weights / mx.maximum(weights.sum(axis=-1, keepdims=True), 1e-30)


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_dict(cls, config: dict) -> BertConfig:
        return cls(**{name: config[name] for name in cls.__dataclass_fields__
                      if name in config})


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, ids: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None]
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(mx.zeros_like(ids)))
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, width = x.shape

        def heads(projection: nn.Linear) -> mx.array:
            return projection(x).reshape(batch, length, self.heads, -1).transpose(0, 2, 1, 3)

        scale = (width // self.heads) ** -0.5
        queries, keys, values = heads(self.query), heads(self.key), heads(self.value)
        if mx.default_device() == mx.cpu:  # where MLX's own softmax is slow (see above)
            scores = (queries * scale) @ keys.transpose(0, 1, 3, 2) + mask
            out = softmax(scores) @ values
        else:
            out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                       mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, width)


class DenseNorm(nn.Module):
    """A projection, added to the residual, then layer norm (BERT's `*.output`)."""

    def __init__(self, inputs: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        self.output = DenseNorm(config.hidden_size, config)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def __call__(self, x: mx.array) -> mx.array:
        return gelu(self.dense(x))


class Layer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        self.output = DenseNorm(config.intermediate_size, config)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = [Layer(config) for _ in range(config.num_hidden_layers)]


class Bert(nn.Module):
    """BERT's encoder: token ids and their padding mask in, last hidden states out."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def __call__(self, ids: mx.array, attention: mx.array) -> mx.array:
        """`attention`: (batch, length), 1 for a real token, 0 for padding."""
        mask = mx.where(attention[:, None, None, :] > 0, 0.0, -mx.inf).astype(mx.float32)
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def pool(hidden: mx.array, attention: mx.array, mode: str) -> mx.array:
    """One vector per row from its real tokens' hidden states, as sentence-transformers'
    Pooling module computes it in `mode` (a name from POOLING_MODES)."""
    weights = attention[..., None].astype(hidden.dtype)
    if mode == "cls_token":
        return hidden[:, 0]
    if mode == "lasttoken":
        return hidden[mx.arange(hidden.shape[0]), attention.sum(axis=1) - 1]
    if mode == "max_tokens":
        return mx.where(weights > 0, hidden, -mx.inf).max(axis=1)
    total = (hidden * weights).sum(axis=1)
    count = mx.maximum(weights.sum(axis=1), 1e-9)
    return total / (mx.sqrt(count) if mode == "mean_sqrt_len_tokens" else count)


@dataclass
class SentenceEncoder:
    """A sentence-transformers folder: the encoder, how it pools, whether it normalises,
    and how long an input may be."""

    model: Bert
    pooling: str
    normalize: bool
    max_length: int
    dimensions: int
    # Dimensions the output may be cut to (Matryoshka); None: only its full size.
    matryoshka: tuple[int, ...] | None

    def __call__(self, ids: mx.array, attention: mx.array) -> mx.array:
        pooled = pool(self.model(ids, attention), attention, self.pooling)
        if self.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled


def is_sentence_encoder(path: Path) -> bool:
    """Whether `path` is a sentence-transformers folder around a BERT-family encoder."""
    config = path / "config.json"
    if not (path / "modules.json").is_file() or not config.is_file():
        return False
    return json.loads(config.read_text()).get("model_type") == "bert"


def load_sentence_encoder(path: Path) -> SentenceEncoder:
    config = json.loads((path / "config.json").read_text())
    bert = Bert(BertConfig.from_dict(config))
    weights = {name: array for name, array in mx.load(str(path / "model.safetensors")).items()
               if not name.startswith("pooler.") and not name.endswith("position_ids")}
    bert.load_weights(list(weights.items()))
    mx.eval(bert.parameters())
    modules = json.loads((path / "modules.json").read_text())
    kinds = {module["type"].rsplit(".", 1)[-1]: module for module in modules}
    pooling = "cls_token"
    if "Pooling" in kinds:
        settings = json.loads((path / kinds["Pooling"]["path"] / "config.json").read_text())
        pooling = next(mode for mode in POOLING_MODES if settings.get(f"pooling_mode_{mode}"))
    unsupported = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unsupported:
        raise ValueError(f"sentence-transformers modules not supported: {sorted(unsupported)}")
    st_config = path / "sentence_bert_config.json"
    max_length = config["max_position_embeddings"]
    if st_config.is_file():
        max_length = json.loads(st_config.read_text()).get("max_seq_length") or max_length
    width = config["hidden_size"]
    return SentenceEncoder(bert, pooling, "Normalize" in kinds, max_length, width,
                           matryoshka_dimensions(config, width))
