"""What joining and leaving a decode batch costs on the device: mlx-lm's BatchKVCache
extend/filter (every layer's batch arrays re-created at a new size) against writing the
same row into arrays allocated once. 8B-shaped KV: 32 layers, 8 KV heads, head dim 128."""
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

LAYERS, HEADS, DIM, S = 32, 8, 128, int(sys.argv[1]) if len(sys.argv) > 1 else 1300
def timed(f):
    mx.synchronize(); t = time.perf_counter(); f(); mx.synchronize(); return (time.perf_counter() - t) * 1e3
def batch(rows):
    caches = []
    for _ in range(LAYERS):
        c = BatchKVCache([0] * rows)
        k = mx.random.normal((rows, HEADS, S, DIM)).astype(mx.bfloat16)
        c.update_and_fetch(k, k)
        caches.append(c)
    mx.eval([(c.keys, c.values) for c in caches]); return caches
def extend(caches, new):
    for c, n in zip(caches, new): c.extend(n)
    mx.eval([(c.keys, c.values) for c in caches])
def keep(caches, rows):
    for c in caches: c.filter(mx.array(rows))
    mx.eval([(c.keys, c.values) for c in caches])
for rows in (1, 2, 3, 4, 5, 6, 7):
    caches, new = batch(rows), batch(1)
    a = timed(lambda caches=caches, new=new: extend(caches, new))
    b = timed(lambda caches=caches, rows=rows: keep(caches, list(range(rows))))
    print(f"{rows} rows + 1 joining (S={S}): extend {a:.1f} ms, then filter back {b:.1f} ms")
pool = [mx.zeros((8, HEADS, 2048, DIM), mx.bfloat16) for _ in range(2 * LAYERS)]; mx.eval(pool)
row = mx.random.normal((1, HEADS, S, DIM)).astype(mx.bfloat16); mx.eval(row)
def write(slot):
    for i in range(len(pool)): pool[i][slot:slot + 1, :, :S, :] = row
    mx.eval(pool)
for slot in range(4):
    print(f"the same row written into preallocated slot {slot}: {timed(lambda slot=slot: write(slot)):.1f} ms")
