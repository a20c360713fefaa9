"""Where 8-bit rounding parts an identity chat's greedy answer from the unquantized one:
the step it parts at and the unquantized model's gap between its top two logits there,
and the smallest gap along each answer that did not part.

    python bench/experiments/kv-quant-formats/gaps.py
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from bench.kv_quant import identity_chats
from engine.model_source import resolve_model

sys.path.insert(0, str(Path(__file__).parents[1] / "kv-quant-rotation"))
from greedy import Rounded, diverged_at, rounding

md = resolve_model(None)
model, tok = load(md)
model.set_dtype(mx.float32)
prompts = [
    tok.apply_chat_template(c, add_generation_prompt=True) for c in identity_chats(Path(md), 0)
]
r8 = rounding(8, mx.float32)


def run(p, wrap):
    cache = [wrap(l) for l in make_prompt_cache(model)]
    logits = model(mx.array([p]), cache=cache)
    out = []
    gaps = []
    for _ in range(32):
        lp = logits[0, -1]
        top = mx.sort(lp)[-2:]
        t = int(mx.argmax(lp))
        out.append(t)
        gaps.append(float(top[1] - top[0]))
        logits = model(mx.array([[t]]), cache=cache)
    return out, gaps


for i, p in enumerate(prompts):
    b, g = run(p, lambda l: l)
    q, _ = run(p, lambda l: Rounded(l, r8, r8))
    d = diverged_at(q, b)
    print(
        i,
        "diverge",
        d if d < 32 else "-",
        "gap there",
        round(g[d], 3) if d < 32 else "-",
        "min gap",
        round(min(g), 3),
        "median gap",
        round(sorted(g)[16], 2),
        repr(tok.decode(b[:12])),
        flush=True,
    )
