import itertools
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

model, _ = load(sys.argv[1])
def fwd(tokens, cache):
    mx.synchronize(); t = time.perf_counter()
    model(mx.array([tokens]), cache=cache); mx.eval([c.state for c in cache]); mx.synchronize()
    return (time.perf_counter() - t) * 1e3
def cold(n):
    return fwd(list(range(1, n + 1)), make_prompt_cache(model))
def offset(pre, n, segments=1):
    cache = make_prompt_cache(model)
    fwd(list(range(1, pre + 1)), cache)
    if segments > 1:  # rebuild each layer's cache from `segments` pieces, as a tree hit does
        fresh = make_prompt_cache(model)
        for c, f in zip(cache, fresh):
            k, v = c.keys[..., :c.offset, :], c.values[..., :c.offset, :]
            cuts = list(itertools.pairwise([pre * i // segments for i in range(segments + 1)]))
            f.keys = mx.concatenate([k[..., a:b, :] for a, b in cuts], axis=2)
            f.values = mx.concatenate([v[..., a:b, :] for a, b in cuts], axis=2)
            f.offset = pre
        mx.eval([(f.keys, f.values) for f in fresh]); cache = fresh
    return fwd(list(range(3000, 3000 + n)), cache)
for name, f in [("cold 1210", lambda: cold(1210)), ("cold 234", lambda: cold(234)),
                ("234 after 1260 (model's own cache)", lambda: offset(1260, 234)),
                ("234 after 1260 (cache from 5 segments)", lambda: offset(1260, 234, 5)),
                ("234 after 1500", lambda: offset(1500, 234)), ("1 after 1260", lambda: offset(1260, 1))]:
    runs = [f() for _ in range(5)]
    print(f"{name}: " + " ".join(f"{r:.1f}" for r in runs) + " ms")
