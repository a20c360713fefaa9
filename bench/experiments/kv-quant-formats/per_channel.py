"""Keys (and values) divided by a power-of-two scale per channel before rounding and
multiplied back after (per-channel smoothing, scales from the model's own keys over 1,500
tokens of the demo corpus): the identity chats' greedy answers at 8 and 4 bits.

    python bench/experiments/kv-quant-formats/per_channel.py ["VARIANT;..."]
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from bench.kv_quant import identity_chats
from engine.model_source import resolve_model

sys.path.insert(0, str(Path(__file__).parents[1] / "kv-quant-rotation"))
from greedy import diverged_at, greedy


def trip(bits, g):
    def once(x):
        q = mx.quantize(x.astype(mx.float32), group_size=g, bits=bits)
        return mx.dequantize(*q, group_size=g, bits=bits)

    return lambda x: once(once(x))


class Capture:
    def __init__(self, layer, store):
        self.layer, self.store = layer, store

    def update_and_fetch(self, k, v):
        self.store.append((k, v))
        return self.layer.update_and_fetch(k, v)

    def __getattr__(self, n):
        return getattr(self.layer, n)


class Smoothed:
    def __init__(self, layer, r, sk, sv):
        self.layer, self.r, self.sk, self.sv = layer, r, sk, sv

    def update_and_fetch(self, k, v):
        k2 = (
            (self.r(k / self.sk) * self.sk).astype(k.dtype)
            if self.sk is not None
            else self.r(k).astype(k.dtype)
        )
        v2 = (
            (self.r(v / self.sv) * self.sv).astype(v.dtype)
            if self.sv is not None
            else self.r(v).astype(v.dtype)
        )
        return self.layer.update_and_fetch(k2, v2)

    def __getattr__(self, n):
        return getattr(self.layer, n)


def pow2(x):  # nearest power of two at or above
    return mx.power(2.0, mx.ceil(mx.log2(mx.maximum(x, 1e-6))))


def main():
    md = resolve_model(None)
    model, tok = load(md)
    model.set_dtype(mx.float32)
    text = (
        Path("engine/demo_corpus/prose.txt").read_text()[:6000]
        + Path("engine/demo_corpus/chat.txt").read_text()[:3000]
    )
    ids = tok.encode(text)[:1500]
    caches = make_prompt_cache(model)
    stores = [[] for _ in caches]
    model(mx.array([ids]), cache=[Capture(c, s) for c, s in zip(caches, stores)])
    kmax = [mx.abs(s[0][0]).max(axis=2)[0] for s in stores]  # (heads, D)
    vmax = [mx.abs(s[0][1]).max(axis=2)[0] for s in stores]
    for i in (0, 5, 15, 29):
        km = kmax[i]
        print(
            "layer",
            i,
            "key chan max range",
            float(km.min()),
            float(km.max()),
            "median",
            float(mx.sort(km.flatten())[km.size // 2]),
        )
    # weight-derived: row norms of k_proj
    prompts = [
        tok.apply_chat_template(c, add_generation_prompt=True) for c in identity_chats(Path(md), 0)
    ]
    base = [greedy(model, p, lambda l: l) for p in prompts]
    r8 = trip(8, 64)
    r4 = trip(4, 64)

    def ks(i, m):
        return pow2(m[i])[None, :, None, :]

    variants = {
        "8 plain": lambda i, l: Smoothed(l, r8, None, None),
        "8 keys per-channel": lambda i, l: Smoothed(l, r8, ks(i, kmax), None),
        "8 keys+values per-channel": lambda i, l: Smoothed(l, r8, ks(i, kmax), ks(i, vmax)),
        "4 plain": lambda i, l: Smoothed(l, r4, None, None),
        "4 keys per-channel": lambda i, l: Smoothed(l, r4, ks(i, kmax), None),
        "4 keys+values per-channel": lambda i, l: Smoothed(l, r4, ks(i, kmax), ks(i, vmax)),
    }
    for name in sys.argv[1].split(";") if len(sys.argv) > 1 else variants:
        mk = variants[name]

        def wrap_all(p, mk=mk):
            cache = [mk(i, l) for i, l in enumerate(make_prompt_cache(model))]
            logits = model(mx.array([p]), cache=cache)
            out = []
            for _ in range(32):
                t = int(mx.argmax(logits[0, -1]))
                out.append(t)
                logits = model(mx.array([[t]]), cache=cache)
            return out

        found = [wrap_all(p) for p in prompts]
        eq = sum(a == b for a, b in zip(found, base))
        parted = sorted(diverged_at(a, b) for a, b in zip(found, base) if a != b)
        print(f"{name}: {eq}/32 equal; parted at {parted}", flush=True)


main()
