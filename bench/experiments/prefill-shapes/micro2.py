import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def timed(f):
    mx.synchronize(); t = time.perf_counter(); f(); mx.synchronize(); return (time.perf_counter() - t) * 1e3
W = mx.random.normal((14336, 4096)).astype(mx.bfloat16); mx.eval(W)
print("matmul (M x 4096) @ W.T, first and second call per new M:")
for m in (230, 231, 232, 233, 240, 256, 300, 301):
    x = mx.random.normal((m, 4096)).astype(mx.bfloat16); mx.eval(x)
    a = timed(lambda x=x: mx.eval(x @ W.T))
    b = timed(lambda x=x: mx.eval(x @ W.T))
    print(f"  M={m}: {a:.2f} then {b:.2f} ms")
model, _ = load(sys.argv[1])
def cold(n):
    cache = make_prompt_cache(model)
    return timed(lambda: mx.eval(model(mx.array([list(range(1, n + 1))]), cache=cache)))
print("model cold prefill, first and second call per new length:")
for n in (230, 231, 232, 233, 250, 251, 1210, 1211):
    print(f"  n={n}: {cold(n):.1f} then {cold(n):.1f} ms")
