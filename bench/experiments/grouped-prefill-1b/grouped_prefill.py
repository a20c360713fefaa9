"""Where a grouped prefill of long cached prompts spends its time on the device.

    python grouped_prefill.py MODEL_DIR [--rows 7] [--new 275] [--cached 1500,2045] [--reps 5]
                              [--layout stacked|layers]

The multi-turn workload's later turns as the engine meets them: one chat decoding, then
ROWS other chats' next turns arrive together, each NEW tokens after CACHED cached ones
(each chat its own prefix, in 7 segments as a 4-turn path holds it). Until all ROWS have
their first token, two ways, with the engine's own `Generator`:

  grouped  `Generator.prefill` as the engine runs it: one right-padded forward over a
           batch cache written from the prefixes, rows straight into the decode batch
  single   the same prompts one per step (`_group` turned off): each step decodes the
           batch, feeds one prompt on its own cache, and the next step joins it

Each rep uses NEW + rep tokens, so every rep meets a width the process has not run (as
every turn of the server does); "same" repeats the first width instead. For the grouped
step, a second pass synchronizes the device around each of its parts (prefix_batch, the
forward, finalize, the rows' entry into the decode batch and their first tokens) to say
which costs what; its parts sum to more than the unsynchronized step.
"""

import argparse
import itertools
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models import cache as mlx_lm_cache

import engine.generator as generator_module
from engine.generator import Generator, SequenceState
from engine.kv import KVSegment

SPLITS = (0.59, 0.03, 0.13, 0.03, 0.13, 0.03)  # a 4-turn path: prompt, reply, prompt, ...
BUDGET = 4096  # the step's prefill budget: enough for every prompt of the group


def prefix_of(model, vocab, cached, seed, stacked):
    """A chat's cached prefix: `cached` random tokens' KV as 7 segments, and the tokens.
    `stacked`: each segment's arrays stacked over layers, as the engine's copies out of a
    batch are (`BatchRow.span`); else a list of per-layer arrays, as copies out of a
    single-sequence cache are (`KVSegment.from_cache`)."""
    tokens = mx.random.randint(0, vocab, (1, cached), key=mx.random.key(seed))
    cache = mlx_lm_cache.make_prompt_cache(model)
    model(tokens, cache=cache)
    cuts = [0]
    for share in SPLITS:
        cuts.append(cuts[-1] + int(share * cached))
    cuts.append(cached)
    segments = [KVSegment.from_cache(cache, a, b) for a, b in itertools.pairwise(cuts) if b > a]
    if stacked:
        segments = [KVSegment(mx.stack(s.keys), mx.stack(s.values)) for s in segments]
    mx.eval([s.arrays for s in segments])
    return segments, tokens[0].tolist()


def sequence(uid, prefix, tokens, new):
    return SequenceState(uid=uid, cache=None, tokens=list(tokens), unfed=list(new),
                         sampler=None, processors=[], wants_logprobs=False,
                         prefix=list(prefix))


def decoding_generator(model, chat, new):
    """A generator whose batch decodes one chat (the turn that arrived first)."""
    g = Generator(model)
    g.add(sequence(0, *chat, new))
    while not g.rows:
        g.decode()
        g.prefill(BUDGET)
    g.decode()
    mx.eval(g.inputs)
    return g


def admit(model, chats, new, grouped):
    """Seconds from the step that admits `chats`' turns until all have a first token
    (read back), and the steps it took."""
    g = decoding_generator(model, chats[0], new)
    if not grouped:
        g._group = lambda budget: ([], None)
    for uid, (prefix, tokens) in enumerate(chats[1:], start=1):
        g.add(sequence(uid, prefix, tokens, new))
    mx.synchronize()
    start, steps = time.perf_counter(), 0
    while g.prefilling or g.ready:
        steps += 1
        g.decode()
        g.prefill(BUDGET)
    mx.eval(g.inputs)
    return time.perf_counter() - start, steps


class Parts:
    """Synchronized wall time of the grouped step's parts, by patching the names
    `Generator._prefill_together` calls."""

    def __init__(self):
        self.ms = {}

    def wrap(self, name, fn, result=lambda out: out):
        def timed(*args, **kwargs):
            mx.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(result(out))
            mx.synchronize()
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3
            return out
        return timed


def parts_of_grouped(model, chats, new):
    parts = Parts()
    g = decoding_generator(model, chats[0], new)
    for uid, (prefix, tokens) in enumerate(chats[1:], start=1):
        g.add(sequence(uid, prefix, tokens, new))
    g.decode()
    mx.eval(g.inputs)
    original_batch, original_finalize = generator_module.prefix_batch, \
        mlx_lm_cache.BatchKVCache.finalize
    original_enter, original_model = g._enter, g.model
    generator_module.prefix_batch = parts.wrap(
        "prefix_batch", original_batch, lambda c: [(x.keys, x.values) for x in c])

    def finalize_all(self):
        original_finalize(self)
        return self
    mlx_lm_cache.BatchKVCache.finalize = parts.wrap(
        "finalize", finalize_all, lambda c: [c.keys, c.values])
    g._enter = parts.wrap("enter+sample", original_enter)
    g.model = parts.wrap("forward", original_model)
    try:
        mx.synchronize()
        start = time.perf_counter()
        g.prefill(BUDGET)
        mx.eval(g.inputs)
        parts.ms["whole prefill"] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        g.model = original_model
        g.decode()
        mx.eval(g.inputs)
        parts.ms["next decode step"] = (time.perf_counter() - start) * 1e3
    finally:
        generator_module.prefix_batch = original_batch
        mlx_lm_cache.BatchKVCache.finalize = original_finalize
    return parts.ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--rows", type=int, default=7)
    parser.add_argument("--new", type=int, default=275)
    parser.add_argument("--cached", default="1500,2045")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layout", choices=("stacked", "layers"), default="stacked")
    args = parser.parse_args()
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    print(f"device {mx.default_device()}, rows {args.rows}+1 decoding, new {args.new}, "
          f"segments {args.layout}")
    for cached in (int(c) for c in args.cached.split(",")):
        chats = [prefix_of(model, vocab, cached + 7 * i, i, args.layout == "stacked") for i in range(args.rows + 1)]
        new = mx.random.randint(0, vocab, (args.new + args.reps,)).tolist()
        admit(model, chats, new[:args.new - 1], True)  # warm the common kernels
        admit(model, chats, new[:args.new - 1], False)
        for way, grouped in (("grouped", True), ("single", False)):
            for widths in ("new", "same"):
                runs = [admit(model, chats, new[:args.new + (rep if widths == "new" else 0)],
                              grouped) for rep in range(args.reps)]
                times = [t * 1e3 for t, _ in runs]
                print(f"cached {cached:5d}  {way:8s} widths {widths:4s}  steps {runs[0][1]:2d}  "
                      f"ms median {statistics.median(times):7.1f}  first {times[0]:7.1f}  "
                      f"all {' '.join(f'{t:.1f}' for t in times)}", flush=True)
        parts = [parts_of_grouped(model, chats, new[:args.new]) for _ in range(3)]
        print(f"cached {cached:5d}  grouped parts, synchronized (median of 3, ms): " + ", ".join(
            f"{k} {statistics.median(p[k] for p in parts):.1f}" for k in parts[0]), flush=True)


if __name__ == "__main__":
    main()
