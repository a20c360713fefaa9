"""What ordering a long queue by cached prefix costs the engine thread each step.

    PYTHONPATH=. python bench/experiments/admission-peek/measure.py   # the tests folder too

A radix tree (test doubles for its KV) holding 256 conversations of three turns behind
1,000-token system prompts, and 192 of their next turns waiting: the milliseconds one
admission round spends on `RadixTree.peek` of every waiting prompt (all but its last
token), as `engine.admission.admit` orders them. On the 2-core EPYC: 3.9-6.4 ms (a machine busy or quiet).
"""

from __future__ import annotations

import random
import time

from radix.tree import RadixTree
from tests.radix.support import FakeHandle


def main() -> None:
    rng = random.Random(0)
    tree = RadixTree(1 << 40, lambda handle: None)
    waiting = []
    for _ in range(256):
        tokens = [rng.randrange(50000) for _ in range(1000 + 3 * 264)]
        tree.insert(tree.root, tokens, FakeHandle(tokens))
        waiting.append(tokens + [rng.randrange(50000) for _ in range(200)])
    rounds = 10
    start = time.perf_counter()
    for _ in range(rounds):
        for prompt in waiting[:192]:
            tree.peek(prompt[:-1])
    print(f"peek of 192 waiting prompts: {(time.perf_counter() - start) / rounds * 1000:.1f} ms")


if __name__ == "__main__":
    main()
