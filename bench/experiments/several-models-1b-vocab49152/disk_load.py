"""How fast the disk tier reads a node's KV back, and which part takes the time.

Writes one segment file of the Llama-1B shape (16 layers, 8 KV heads of 64, bfloat16)
through the real DiskStore, then times, medians of repeats with the file in the page
cache: the whole `read_copy`, its checksums alone (on the pool), and MLX's reading alone.

    python bench/experiments/several-models-1b-vocab49152/disk_load.py [--tokens 3044] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlx.core as mx

from engine import segment_file
from engine.disk_store import DiskStore, read_copy
from engine.kv import KVSegment

LAYERS, HEADS, HEAD_DIM = 16, 8, 64


def timed(repeats: int, work) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=3044)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    shape = (1, HEADS, args.tokens, HEAD_DIM)
    layers = [tuple(mx.random.normal(shape).astype(mx.bfloat16) for _ in range(LAYERS))
              for _ in range(2)]
    mx.eval(layers)
    with tempfile.TemporaryDirectory() as folder:
        store = DiskStore(Path(folder), 2**36, "f" * 32, True, 2**33)
        tokens = tuple(range(args.tokens))
        copy = store.save(store.root_state.follow(tokens).key, store.root_state, 0, tokens,
                          KVSegment(*layers))
        assert store.flush(60) and copy is not None
        size = copy.path.stat().st_size

        def checksums_only() -> None:
            segment_file.read(copy.path, lambda name: None)

        def mlx_only() -> None:
            mx.eval(list(mx.load(str(copy.path)).values()))

        parts = {"read_copy": lambda: read_copy(copy.path),
                 "checksums alone": checksums_only, "mx.load alone": mlx_only}
        print(f"device {mx.default_device()}, {size / 1e6:.1f} MB, {args.tokens} tokens")
        for label, work in parts.items():
            seconds = timed(args.repeats, work)
            print(f"{label:16s} {seconds * 1e3:7.1f} ms  {size / seconds / 1e9:5.2f} GB/s")
        store.close()


if __name__ == "__main__":
    main()
