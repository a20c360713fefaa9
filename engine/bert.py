"""A BERT-family encoder in MLX and the sentence-transformers pipeline around it: the
Transformer module, then the model's own pooling and normalisation (`modules.json`,
`1_Pooling/config.json`), so a sentence-transformers folder embeds here as it does there.

Written here rather than taken from mlx-embeddings: that package is GPL-3.0 and pulls in
mlx-vlm and transformers>=5 for what is, for BERT, one small forward; the parameter names
below are Hugging Face's, so a `model.safetensors` loads as it is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
from mlx import nn

from engine import cpu_math
from engine.embedding_config import matryoshka_dimensions
from engine.encoder_folder import json_file

# The pooling modes sentence-transformers' Pooling config can switch on, in its order.
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens",
                 "lasttoken")


# MLX's CPU backend computes `erf` and `exp` at 20-40 ns an element, so GELU over every
# intermediate activation and softmax over every attention score cost more than all of
# MiniLM's matrix products there. GELU is written below in multiplies and adds, which
# `mx.compile` fuses into one loop, at 2-4 ns an element (tests check it against MLX's
# own); softmax is engine.cpu_math's.

# Abramowitz and Stegun 7.1.28: erf(x) = 1 - (1 + a1 x + ... + a6 x^6)^-16 for x >= 0,
# within 3e-7.
ERF_COEFFICIENTS = (0.0705230784, 0.0422820123, 0.0092705272, 0.0001520143, 0.0002765672,
                    0.0000430638)


# The same erf in x rather than x / sqrt 2: a_k / sqrt(2)^k.
GELU_COEFFICIENTS = tuple(coefficient * 2 ** -(k / 2)
                          for k, coefficient in enumerate(ERF_COEFFICIENTS, start=1))


@partial(mx.compile, shapeless=True)
def _gelu_polynomial(x: mx.array) -> mx.array:
    # Estrin's scheme: a shallow graph, so that it fuses into one loop (see `gelu`).
    a = mx.abs(x)
    a2 = a * a
    c = GELU_COEFFICIENTS
    return (((1.0 + c[0] * a) + (c[1] + c[2] * a) * a2)
            + ((c[3] + c[4] * a) + c[5] * a2) * (a2 * a2))


@partial(mx.compile, shapeless=True)
def _gelu_from_polynomial(x: mx.array, polynomial: mx.array) -> mx.array:
    power = polynomial
    for _ in range(4):
        power = power * power
    half = 0.5 * mx.abs(x)
    return (0.5 * x + half) - half / power


def gelu(x: mx.array) -> mx.array:
    """BERT's exact (erf) GELU: x/2 (1 + erf(x / sqrt 2)), which is
    relu(x) - |x|/2 (1 - erf(|x| / sqrt 2)) = relu(x) - |x|/2 p(|x|)^-16.

    In two compiled halves: MLX fuses a chain of at most 11 operations (a shapeless
    compile's broadcasts count), so the whole formula as one function became five
    loops over the activation; two shallow halves are two, each vectorised (no min, max
    or where, on which MLX's CPU loops branch and do not vectorise): six GELUs of
    832 x 1536 took 16 ms on a 2-core AMD EPYC, now 7.6.
    """
    return _gelu_from_polynomial(x, _gelu_polynomial(x))


@partial(mx.compile, shapeless=True)
def _squared_deviation(x: mx.array, mean: mx.array) -> mx.array:
    deviation = x - mean
    return deviation * deviation


@partial(mx.compile, shapeless=True)
def _normalized(x: mx.array, mean: mx.array, inverse_deviation: mx.array, weight: mx.array,
                bias: mx.array) -> mx.array:
    return (x - mean) * inverse_deviation * weight + bias


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (its parameters, as Hugging Face names them); on the CPU, with the
    mean and the variance over the last axis as matrix-vector products (OpenBLAS's,
    vectorised) around two fused loops, where MLX's CPU layer norm is a scalar loop:
    12 layer norms of 832 x 384 took 11 ms on a 2-core AMD EPYC, now 8. The variance is
    taken about the mean (two passes), so it is no less exact than MLX's."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__(dims, eps=eps)
        self._averaging = mx.full((dims, 1), 1 / dims)  # underscore: not a parameter

    def __call__(self, x: mx.array) -> mx.array:
        if mx.default_device() != mx.cpu:
            return super().__call__(x)
        mean = x @ self._averaging
        variance = _squared_deviation(x, mean) @ self._averaging
        return _normalized(x, mean, mx.rsqrt(variance + self.eps), self.weight, self.bias)


# Model types whose encoder is BERT's but numbered as RoBERTa numbers positions.
ROBERTA_MODEL_TYPES = ("roberta", "xlm-roberta")


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
    # RoBERTa's pad token id, from which it numbers positions; None: BERT's 0, 1, 2...
    padding_idx: int | None = None

    @classmethod
    def from_dict(cls, config: dict) -> BertConfig:
        fields = {name: config[name] for name in cls.__dataclass_fields__ if name in config}
        if config.get("model_type") in ROBERTA_MODEL_TYPES:
            fields["padding_idx"] = config["pad_token_id"]
        return cls(**fields)

    @property
    def positions(self) -> int:
        """How many tokens one input may have: RoBERTa's first position is padding_idx + 1."""
        offset = 0 if self.padding_idx is None else self.padding_idx + 1
        return self.max_position_embeddings - offset


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.padding_idx = config.padding_idx

    def __call__(self, ids: mx.array, token_types: mx.array | None) -> mx.array:
        types = mx.zeros_like(ids) if token_types is None else token_types
        x = (self.word_embeddings(ids) + self.position_embeddings(self.positions(ids))
             + self.token_type_embeddings(types))
        return self.LayerNorm(x)

    def positions(self, ids: mx.array) -> mx.array:
        if self.padding_idx is None:
            return mx.arange(ids.shape[1])[None]
        # RoBERTa's, as Hugging Face computes them: from padding_idx + 1, every pad token
        # at padding_idx. Rows padded here with another id number their padding on, within
        # the table (an input is at most `BertConfig.positions` long) and masked anyway.
        real = (ids != self.padding_idx).astype(mx.int32)
        return mx.cumsum(real, axis=1) * real + self.padding_idx


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        batch, length, width = x.shape
        size = width // self.heads
        scale = size ** -0.5
        if mx.default_device() == mx.cpu:  # where MLX's own softmax is slow (see above)
            # Each projection's bias added as its heads are laid out for the products
            # (keys already transposed): one pass makes both, where the bias copy of
            # `addmm` and the copy of a transposed view were two.
            def laid_out(projection: nn.Linear, axes: tuple[int, ...], bias: tuple[int, ...]
                         ) -> mx.array:
                products = linear(projection, x, bias=False)
                return (products.reshape(batch, length, self.heads, size).transpose(axes)
                        + projection.bias.reshape(bias))

            queries = laid_out(self.query, (0, 2, 1, 3), (self.heads, 1, size))
            keys = laid_out(self.key, (0, 2, 3, 1), (self.heads, size, 1))
            values = laid_out(self.value, (0, 2, 1, 3), (self.heads, 1, size))
            out = cpu_math.softmax((queries * scale) @ keys + mask) @ values
        else:
            def heads(projection: nn.Linear) -> mx.array:
                return projection(x).reshape(batch, length, self.heads, size).transpose(
                    0, 2, 1, 3)

            out = mx.fast.scaled_dot_product_attention(
                heads(self.query), heads(self.key), heads(self.value), scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, width)


def linear(layer: nn.Linear, x: mx.array, bias: bool = True) -> mx.array:
    """`layer(x)`; on the CPU, the product and then the bias added (or not, where the
    caller adds it), as MLX's CPU `addmm` first copies the broadcast bias into its output
    in a scalar loop: with BERT's six projections a layer, a few percent of a forward."""
    if mx.default_device() != mx.cpu:
        return layer(x)
    products = x @ layer.weight.T
    return products + layer.bias if bias else products


class DenseNorm(nn.Module):
    """A projection, added to the residual, then layer norm (BERT's `*.output`)."""

    def __init__(self, inputs: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(linear(self.dense, x) + residual)


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
        return gelu(linear(self.dense, x))


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
    """BERT's encoder (RoBERTa's too, but for its positions): token ids, their padding
    mask and, for a pair of texts, which text each token is from in; last hidden states
    out."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def __call__(self, ids: mx.array, attention: mx.array,
                 token_types: mx.array | None = None) -> mx.array:
        """`attention`: (batch, length), 1 for a real token, 0 for padding; `token_types`:
        0 for the first text, 1 for the second (None: all 0)."""
        mask = mx.where(attention[:, None, None, :] > 0, 0.0, -mx.inf).astype(mx.float32)
        x = self.embeddings(ids, token_types)
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
    matryoshka: Sequence[int] | None

    def __call__(self, ids: mx.array, attention: mx.array,
                 token_types: mx.array | None = None) -> mx.array:
        pooled = pool(self.model(ids, attention, token_types), attention, self.pooling)
        if self.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return pooled


def load_weights(path: Path) -> dict[str, mx.array]:
    """The folder's `model.safetensors`, less the position-id buffers old checkpoints
    carry; a folder with only PyTorch's pickle is refused by name (loading one runs code)."""
    weights = path / "model.safetensors"
    if not weights.is_file():
        found = [name for name in ("pytorch_model.bin", "model.safetensors.index.json")
                 if (path / name).is_file()]
        raise FileNotFoundError(
            f"{path} has no model.safetensors, the one weights file this server reads"
            + (f" (it has {', '.join(found)}: convert it to model.safetensors)" if found
               else ""))
    return {name: array for name, array in mx.load(str(weights)).items()
            if not name.endswith("position_ids")}


def max_input_tokens(path: Path, config: BertConfig) -> int:
    """An input's most tokens, as sentence-transformers' Transformer module sets it:
    `max_seq_length` in sentence_bert_config.json, else the tokenizer's
    `model_max_length` capped at the model's positions (and never past them)."""
    limit = json_file(path / "sentence_bert_config.json").get("max_seq_length")
    if not limit:
        positions = config.max_position_embeddings
        limit = min(positions, json_file(path / "tokenizer_config.json").get(
            "model_max_length", positions))
    return min(limit, config.positions)


def sentence_transformers_modules(path: Path, supported: set[str]) -> dict[str, dict]:
    """The modules a sentence-transformers folder chains (modules.json), by kind; a kind
    not `supported` is refused, since it would not be computed."""
    kinds = {module["type"].rsplit(".", 1)[-1]: module
             for module in json_file(path / "modules.json") or ()}
    unsupported = set(kinds) - supported
    if unsupported:
        raise ValueError(f"sentence-transformers modules not supported: {sorted(unsupported)}")
    return kinds


def load_sentence_encoder(path: Path) -> SentenceEncoder:
    config = json.loads((path / "config.json").read_text())
    bert_config = BertConfig.from_dict(config)
    bert = Bert(bert_config)
    bert.load_weights([(name, array) for name, array in load_weights(path).items()
                       if not name.startswith("pooler.")])
    mx.eval(bert.parameters())
    kinds = sentence_transformers_modules(path, {"Transformer", "Pooling", "Normalize"})
    pooling = "cls_token"
    if "Pooling" in kinds:
        settings = json.loads((path / kinds["Pooling"]["path"] / "config.json").read_text())
        pooling = next(mode for mode in POOLING_MODES if settings.get(f"pooling_mode_{mode}"))
    width = config["hidden_size"]
    return SentenceEncoder(bert, pooling, "Normalize" in kinds,
                           max_input_tokens(path, bert_config), width,
                           matryoshka_dimensions(config, width))
