"""Does a Hadamard rotation before rounding keep quantized KV's greedy answers? For the
32 identity chats of bench/kv_quant.py, greedy answers with every KV write rounded as a
`--kv-bits` server rounds it (two round trips, every token over every other as kept),
with and without the keys (and values) turned by an orthonormal Hadamard matrix first:
how many equal the unquantized answer. In exact arithmetic the rotated variants are what
rotating queries and keys in attention computes.

    python bench/experiments/kv-quant-rotation/greedy.py [MODEL_DIR|-] [float32|bfloat16] \
        ["VARIANT;..."]
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from bench.kv_quant import IDENTITY_OUTPUT_TOKENS, identity_chats
from engine.kv_quant import KVQuantization
from engine.model_source import resolve_model


def hadamard(d: int) -> mx.array:
    h = mx.array([[1.0]])
    while h.shape[0] < d:
        h = mx.concatenate([mx.concatenate([h, h], 1), mx.concatenate([h, -h], 1)], 0)
    return h / d ** 0.5


def rounding(bits: int, dtype: mx.Dtype, trips: int = 2):
    """The server's rounding (`KVQuantization.round`: two round trips, the model's dtype
    between them), or a single round trip."""
    quantization = KVQuantization(bits, 64, dtype)
    if trips == 2:
        return quantization.round
    return lambda x: quantization.dequantize(*quantization.quantize(x))


def bfloat16(x):
    return x.astype(mx.bfloat16).astype(x.dtype)


def diverged_at(found: list[int], base: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(found, base)) if a != b), len(base))


class Rounded:
    def __init__(self, layer, round_keys, round_values):
        self.layer, self.rk, self.rv = layer, round_keys, round_values

    def update_and_fetch(self, keys, values):
        return self.layer.update_and_fetch(self.rk(keys), self.rv(values))

    def __getattr__(self, name):
        return getattr(self.layer, name)


def greedy(model, prompt, wrap):
    cache = [wrap(layer) for layer in make_prompt_cache(model)]
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(IDENTITY_OUTPUT_TOKENS):
        token = int(mx.argmax(logits[0, -1]))
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


def main(model_dir: str, dtype: str) -> None:
    model, tokenizer = load(model_dir)
    model.set_dtype(getattr(mx, dtype))
    config = model.args
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rot = hadamard(d).astype(mx.float32)
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True)
               for chat in identity_chats(Path(model_dir), 0)]
    base = [greedy(model, p, lambda layer: layer) for p in prompts]
    def turned(r):
        return lambda x: (r(x.astype(mx.float32) @ rot) @ rot.T).astype(x.dtype)

    kv_dtype = getattr(mx, dtype)
    eight, four = rounding(8, kv_dtype), rounding(4, kv_dtype)
    eight_once = rounding(8, kv_dtype, trips=1)
    variants = {
        "8 bits, plain": (eight, eight),
        "8 bits, rotate keys": (turned(eight), eight),
        "8 bits, rotate keys and values": (turned(eight), turned(eight)),
        "8 bits, rotate keys, one trip": (turned(eight_once), eight_once),
        "bfloat16 KV": (bfloat16, bfloat16),
        "4 bits, plain": (four, four),
        "4 bits, rotate keys": (turned(four), four),
        "4 bits, rotate keys and values": (turned(four), turned(four)),
    }
    chosen = sys.argv[3].split(";") if len(sys.argv) > 3 else list(variants)
    for name in chosen:
        rk, rv = variants[name]
        found = [greedy(model, p, lambda layer, rk=rk, rv=rv: Rounded(layer, rk, rv)) for p in prompts]
        equal = sum(a == b for a, b in zip(found, base))
        parted = sorted(diverged_at(a, b) for a, b in zip(found, base) if a != b)
        print(f"{dtype} {name}: {equal} of {len(prompts)} equal; the others part at tokens "
              f"{parted}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else resolve_model(None),
         sys.argv[2] if len(sys.argv) > 2 else "float32")
