"""Do reads replayed from a trace read what the built forward reads, on this device?

    python bench/experiments/compiled-read/same_reads.py MODEL_DIR [--rows 64,128]

For each row count, rows of 9-17 random tokens over one 48-token preamble are read three
times by a generator with compiled reads (built: the shape's first time; traced; replayed)
and once by one without, and the script prints per row count whether the tokens, top-5
ids and hidden states' shapes agree, and the largest logprob difference.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engine.compiled_read import CompiledReads
from engine.generator import Generator

PREAMBLE = 48


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rows", default="64,128")
    args = parser.parse_args()
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    preamble = mx.random.randint(1000, vocab, (1, PREAMBLE), key=mx.random.key(0))
    cache = make_prompt_cache(model)
    model(preamble, cache=cache)
    span = ([c.keys[..., :PREAMBLE, :] for c in cache],
            [c.values[..., :PREAMBLE, :] for c in cache], PREAMBLE)
    mx.eval(span[0], span[1])
    for rows in map(int, args.rows.split(",")):
        lengths = mx.random.randint(9, 18, (rows,), key=mx.random.key(rows)).tolist()
        feeds = [mx.random.randint(1000, vocab, (n,), key=mx.random.key(1000 + i)).tolist()
                 for i, n in enumerate(lengths)]
        built = Generator(model)
        built.compiled_reads = None
        want = built.read_together([[span]] * rows, feeds, top=5, asked=[], hidden=True)
        compiled = Generator(model)  # the model's hidden states are the latest generator's
        if compiled.compiled_reads is None:  # the CPU: switched on as the tests do
            compiled.compiled_reads = CompiledReads(model, compiled.hidden)
        for attempt in ("built", "traced", "replayed"):
            got = compiled.read_together([[span]] * rows, feeds, top=5, asked=[], hidden=True)
            print(json.dumps({
                "rows": rows, "read": attempt,
                "same_tokens": got.tokens == want.tokens,
                "same_top5": got.top_ids == want.top_ids,
                "max_logprob_diff": max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)),
                "max_hidden_diff": max(abs(a - b) for g, w in zip(got.hidden, want.hidden)
                                       for a, b in zip(g, w)),
            }), flush=True)


if __name__ == "__main__":
    main()
