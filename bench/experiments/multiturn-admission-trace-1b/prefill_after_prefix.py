"""What a multi-turn admission's prefill costs on the device, by cached prefix length.

    MLX_CUDA_USE_CUDNN_SDPA=0 python prefill_after_prefix.py MODEL_DIR [--new-lengths]

For each cached length C (0, then the multi-turn workload's 1214, 1490, 1770, 2045), a
266-token forward over a single-sequence cache holding C tokens, as the engine's `_feed`
runs it: the cache built (a) as one presized segment, (b) assembled from 7 segments as a
4-turn path is (`engine.kv.assemble`). Median of 7 timed runs after 2 warm-ups, each run
synchronized before and after; the assembly timed apart from the forward. With
`--new-lengths` each forward feeds one token more than the one before (266, 267, ...), so
that no forward repeats a shape, as a server's turns do not.
"""

import itertools
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load

from engine.kv import KVSegment, assemble

NEW = 266
SPLITS = (0.59, 0.03, 0.13, 0.03, 0.13, 0.03)  # a 4-turn path: prompt, reply, prompt, ...


def segments(cache, cached, parts):
    """The first `cached` tokens of `cache` as `parts` segments."""
    cuts = [0]
    for share in SPLITS[:parts - 1]:
        cuts.append(cuts[-1] + int(share * cached))
    cuts.append(cached)
    out = []
    for start, end in itertools.pairwise(cuts):
        if end > start:
            seg = KVSegment.from_cache(cache, start, end)
            mx.eval(seg.arrays)
            out.append(seg)
    return out


def timed(setup, fn, runs=7, warm=2):
    """Median ms of `fn(setup())` after `warm` untimed runs, the device synchronized
    before and after each (`setup`'s work is not timed)."""
    times = []
    for i in range(warm + runs):
        arg = setup()
        mx.synchronize()
        start = time.perf_counter()
        fn(arg)
        mx.synchronize()
        if i >= warm:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    model, _ = load(sys.argv[1])
    lengths = itertools.count(NEW) if "--new-lengths" in sys.argv[2:] else itertools.repeat(NEW)
    vocab = model.args.vocab_size
    tokens = mx.random.randint(0, vocab, (1, 2045 + NEW + 128))
    full = assemble([], model)
    model(tokens[:, :2045], cache=full)
    mx.eval([c.state for c in full])
    print("cached  parts  assemble_ms  forward_ms")
    for cached in (0, 1214, 1490, 1770, 2045):
        for parts in (1, 7):
            if cached == 0 and parts > 1:
                continue
            segs = segments(full, cached, parts) if cached else []

            def built(segs=segs):
                cache = assemble(segs, model)
                mx.eval([c.state for c in cache])
                return cache

            def forward(cache):
                model(tokens[:, 2045:2045 + next(lengths)], cache=cache)
                mx.eval([c.state for c in cache])

            assemble_ms = timed(lambda: None, lambda _, segs=segs: built(segs))
            forward_ms = timed(built, forward)
            print(f"{cached:6d}  {parts:5d}  {assemble_ms:11.2f}  {forward_ms:10.2f}", flush=True)


if __name__ == "__main__":
    main()
