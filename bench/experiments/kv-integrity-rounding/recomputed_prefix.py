"""How far a quantized node's KV lies from kv_integrity's check where the node was computed
over another computation of its prefix than the one the tree keeps (a request that
computed the prefix beside another, or before a restart's rebuild put its old files below
a prefix computed anew), against where it follows another prefix altogether.

On one text: 600 tokens P, the 40 after them C, and 600 other tokens O. P and C in one
forward; P again in chunks of CHUNK; O and C in one forward; all rounded as a `--kv-bits`
engine rounds. Then C's KV is checked as kv_integrity checks it (a forward over the kept
KV), over the same computation of P, over the chunked one, and C's KV after O over P.
Prints the share of C's values more than 0.5, 1.5, 2.5 and 4.5 grid steps off.

    python bench/experiments/kv-integrity-rounding/recomputed_prefix.py MODEL_DIR BITS CHUNK
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.demo_model import corpus_texts
from engine.kv import KVSegment
from engine.kv_quant import KVQuantization
from engine.mlx_lm_internals import kv_layout, rounded_writes
from tests.engine import kv_integrity

THRESHOLDS = (0.5, 1.5, 2.5, 4.5)


def main(model_dir: str, bits: int, chunk: int) -> None:
    model, tokenizer = load(model_dir)
    quantization = KVQuantization(bits, 64, kv_layout(model)[0])
    ids = tokenizer.encode(corpus_texts()[0])
    prefix, continuation, other = ids[:600], ids[600:640], ids[700:1300]

    def forward(tokens: list[int], step: int) -> list:
        cache = make_prompt_cache(model)
        rounded = rounded_writes(cache, quantization.round)
        for start in range(0, len(tokens), step):
            model(mx.array([tokens[start:start + step]]), cache=rounded)
            mx.eval([layer.state for layer in cache])
        return cache

    def span(cache: list, start: int, end: int) -> KVSegment:
        return KVSegment.of([c.keys[..., start:end, :] for c in cache],
                            [c.values[..., start:end, :] for c in cache], quantization)

    whole = forward(prefix + continuation, len(prefix) + len(continuation))
    chunked = forward(prefix, chunk)
    after_other = forward(other + continuation, len(other) + len(continuation))
    path = tuple(prefix + continuation)
    node = span(whole, len(prefix), len(path))
    for name, kept, checked in (
            ("over the prefix it was computed over", span(whole, 0, len(prefix)), node),
            (f"over the prefix computed in chunks of {chunk}", span(chunked, 0, len(prefix)),
             node),
            ("after 600 other tokens", span(whole, 0, len(prefix)),
             span(after_other, len(other), len(other) + len(continuation)))):
        fresh = kv_integrity._fresh(model, path, {}, (quantization, [kept, checked]))
        over, values = [0] * len(THRESHOLDS), 0
        for side, layers in enumerate((checked.keys, checked.values)):
            for layer, computed in enumerate(fresh):
                stored = layers[layer]
                steps = (mx.abs(stored - computed[side][..., len(prefix):, :])
                         / kv_integrity._step(checked, side, layer, stored))
                over = [n + int((steps > t).sum()) for n, t in zip(over, THRESHOLDS)]
                values += steps.size
        print(f"{bits} bits, C {name}: share more than "
              + ", ".join(f"{t} steps {n / values:.4f}" for t, n in zip(THRESHOLDS, over)))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
