"""Micro-benchmark of `radix.prefix.common_prefix_length` on long prompts, against the two
ways it replaced: comparing token by token after a failed whole comparison (the tree's
old edge match) and bisecting on slice comparisons (the old list version).

    python -m bench.prefix_bench [--tokens 8192,32768]

Token ids are distinct int objects, as two tokenizer outputs are (equal small ints would
compare by identity). Prints CPU microseconds per call, the median of five runs, as a
Markdown table: a tree walk (`RadixTree.peek`) over one cached prompt with each function
as its edge match, and each function alone on lists.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

import radix.tree
from radix import RadixTree
from radix.prefix import common_prefix_length

RUNS = 5


def token_by_token(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    n = min(len(a), len(b) - start)
    if a[:n] == b[start : start + n]:
        return n
    i = 0
    while a[i] == b[start + i]:
        i += 1
    return i


def bisection(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    low, high = 0, min(len(a), len(b) - start)
    if a[:high] == b[start : start + high]:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[start : start + mid]:
            low = mid
        else:
            high = mid
    return low


FUNCTIONS = {"common_prefix_length": common_prefix_length, "token by token": token_by_token,
             "bisection": bisection}


class Blob:
    splittable = True

    def __init__(self, ntokens: int) -> None:
        self.nbytes = ntokens

    def split(self, at: int) -> tuple[Blob, Blob]:
        return Blob(at), Blob(self.nbytes - at)


def cpu_us(call: Callable[[], object], repeats: int) -> float:
    start = time.process_time()
    for _ in range(repeats):
        call()
    return (time.process_time() - start) / repeats * 1e6


def cases(tokens: int, rng: random.Random) -> dict[str, tuple[list[int], list[int]]]:
    """A cached run and queries that match it whole or differ at a position."""
    cached = [rng.randrange(1000, 150000) for _ in range(tokens)]
    queries = {}
    for name, at in (("whole", None), ("differs at 10", 10), ("differs at 1000", 1000),
                     ("differs at 3/4", 3 * tokens // 4)):
        query = [int(str(t)) for t in cached] + [7] * 100  # fresh int objects
        if at is not None:
            query[at] = -1
        queries[name] = query
    return {name: (cached, query) for name, query in queries.items()}


def medians(calls: dict[str, Callable[[], object]], repeats: int,
            install: Callable[[Callable], None] = lambda function: None) -> list[float]:
    """Each call's median CPU time, the calls alternated so that load from other work
    falls on all alike; `install` puts each function in place before its call."""
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(RUNS):
        for label, call in calls.items():
            install(FUNCTIONS[label])
            times[label].append(cpu_us(call, repeats))
    install(common_prefix_length)
    return [statistics.median(times[label]) for label in calls]


def install(function: Callable) -> None:
    """Make `function` the tree walk's edge match (`RadixTree.peek` runs in radix.tree)."""
    radix.tree.common_prefix_length = function


def rows(tokens: int, cached: list[int], query: list[int], repeats: int
         ) -> dict[str, list[float]]:
    tree = RadixTree(10**12, lambda handle: None)
    tree.insert(tree.root, tuple(cached), Blob(tokens))
    query_tuple = tuple(query)
    return {
        "RadixTree.peek (tuples)": medians(
            {label: lambda: tree.peek(query_tuple) for label in FUNCTIONS}, repeats, install),
        "the function on lists": medians(
            {label: lambda f=function: f(cached, query) for label, function in FUNCTIONS.items()},
            repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768",
                        help="comma-separated lengths of the cached prompt")
    args = parser.parse_args()
    rng = random.Random(0)
    print("| tokens | case | what | " + " | ".join(FUNCTIONS) + " |")
    print("|---:|---|---|" + "---:|" * len(FUNCTIONS))
    for tokens in map(int, args.tokens.split(",")):
        repeats = max(20, 200_000 // tokens)
        for name, (cached, query) in cases(tokens, rng).items():
            for what, times in rows(tokens, cached, query, repeats).items():
                print(f"| {tokens} | {name} | {what} | "
                      + " | ".join(f"{t:.1f}" for t in times) + " |")


if __name__ == "__main__":
    main()
