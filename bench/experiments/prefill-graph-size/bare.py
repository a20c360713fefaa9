"""The primitives of bare mlx-lm's forward of NEW tokens over CACHED cached ones (a
single-sequence cache, evaluated beforehand), by kind: the floor the server's step graph
(sitecustomize.py here) is set against. Also the graph of building that cache from
PARTS segments as the engine does (`engine.kv.assemble`).

    python bench/experiments/prefill-graph-size/bare.py MODEL_DIR [NEW CACHED PARTS]
"""

import itertools
import sys

import mlx.core as mx
from graph_count import line, primitives
from mlx_lm import load

from engine.kv import KVSegment, assemble


def main():
    model, _ = load(sys.argv[1])
    new, cached, parts = (int(a) for a in (sys.argv[2:5] if len(sys.argv) > 4 else (260, 1800, 7)))
    tokens = mx.random.randint(0, model.args.vocab_size, (1, cached + new))
    full = assemble([], model)
    model(tokens[:, :cached], cache=full)
    mx.eval([c.state for c in full])
    cuts = [cached * i // parts for i in range(parts + 1)]
    segments = [KVSegment.from_cache(full, a, b) for a, b in itertools.pairwise(cuts)]
    mx.eval([s.arrays for s in segments])
    cache = assemble(segments, model)
    print(line(f"assemble {parts} segments", primitives([c.state for c in cache])))
    mx.eval([c.state for c in cache])
    model(tokens[:, cached:], cache=cache)
    print(line(f"forward {new} over {cached}", primitives([c.state for c in cache])))


if __name__ == "__main__":
    main()
