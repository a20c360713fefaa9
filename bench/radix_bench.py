"""Micro-benchmark of the radix tree: per-operation cost as the number of cached nodes grows.

    python -m bench.radix_bench [--sizes 1000,10000,100000,1000000] [--ops 50000]

Builds a tree shaped like a chat workload (one shared system prompt per group, about a
hundred conversations below each), then times `match` of cached sequences, and `insert` of
new ones and eviction of least recently used leaves while churning at a steady size. With
an O(1) LRU list and dict children, no operation walks more than one path, so each should
cost the same at 10^3 and 10^6 nodes. Matching a small hot set shows that; matching any
cached chat adds the CPU cache misses of a heap far larger than the caches. Prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from radix import RadixTree

SYSTEM_TOKENS = 64
CONVERSATION_TOKENS = 32
CONVERSATIONS_PER_GROUP = 100
BYTES_PER_TOKEN = 1024
HOT_SET = 1000


class Blob:
    """The cheapest handle: a size that splits in proportion to tokens."""

    __slots__ = ("ntokens",)
    splittable = True

    def __init__(self, ntokens: int) -> None:
        self.ntokens = ntokens

    @property
    def nbytes(self) -> int:
        return self.ntokens * BYTES_PER_TOKEN

    def split(self, at: int) -> tuple[Blob, Blob]:
        return Blob(at), Blob(self.ntokens - at)


# Shared int objects, so a million edges cost pointers rather than a million ints each.
TOKEN_IDS = list(range(1 << 17))


def conversation(group: int, start: int) -> tuple[int, ...]:
    system = [TOKEN_IDS[group], *TOKEN_IDS[1:SYSTEM_TOKENS]]  # distinct first tokens
    return tuple(system + TOKEN_IDS[start : start + CONVERSATION_TOKENS])


class Workload:
    """A tree of about `nodes` nodes: a system prompt node per group, a leaf per chat."""

    def __init__(self, nodes: int, rng: random.Random) -> None:
        self.rng = rng
        self.groups = max(1, nodes // (CONVERSATIONS_PER_GROUP + 1))
        self.tree = RadixTree(capacity_bytes=1 << 62, free=lambda handle: None)
        self.cached: list[tuple[int, int]] = []
        while self.tree.stats().nodes < nodes:
            for _ in range(100):
                self.insert(self.fresh())

    def fresh(self) -> tuple[int, int]:
        start = self.rng.randrange(len(TOKEN_IDS) - CONVERSATION_TOKENS)
        return self.rng.randrange(self.groups), start

    def insert(self, chat: tuple[int, int]) -> None:
        tokens = conversation(*chat)
        self.tree.insert(self.tree.root, tokens, Blob(len(tokens)))
        self.cached.append(chat)


def measure(nodes: int, ops: int) -> dict[str, float]:
    """Per-call µs of match, and of insert and evict while churning at a steady size."""
    rng = random.Random(nodes)
    started = time.perf_counter()
    work = Workload(nodes, rng)
    tree = work.tree
    row = {"nodes": tree.stats().nodes, "build_s": time.perf_counter() - started}
    # The collector would otherwise rescan the long-lived tree in the timed loops; a
    # server's steady state is a mostly-old heap too.
    gc.collect()
    gc.freeze()
    hot = [rng.choice(work.cached) for _ in range(HOT_SET)]
    fresh = [work.fresh() for _ in range(ops)]
    clock = time.perf_counter
    for column, pool in (("match_hot", hot), ("match", work.cached)):
        queries = [conversation(*rng.choice(pool)) for _ in range(ops)]
        started = clock()
        for tokens in queries:
            tree.match(tokens)
        row[column] = (clock() - started) / ops * 1e6

    leaf_bytes = CONVERSATION_TOKENS * BYTES_PER_TOKEN
    inserting = evicting = 0.0
    for chat in fresh:
        tokens = conversation(*chat)
        t0 = clock()
        tree.insert(tree.root, tokens, Blob(len(tokens)))
        t1 = clock()
        tree.evict(leaf_bytes)
        inserting, evicting = inserting + t1 - t0, evicting + clock() - t1
    row["insert"], row["evict"] = inserting / ops * 1e6, evicting / ops * 1e6

    before = tree.stats()
    started = clock()
    tree.evict(before.total_bytes // 2)
    elapsed = clock() - started
    row["evict_bulk"] = elapsed / (tree.stats().evictions - before.evictions) * 1e6
    gc.unfreeze()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--ops", type=int, default=50000)
    args = parser.parse_args()
    print(
        f"{CONVERSATIONS_PER_GROUP} chats of {CONVERSATION_TOKENS} tokens below each "
        f"{SYSTEM_TOKENS}-token system prompt; {args.ops} ops per column; µs per call.\n"
        "Insert and evict run as churn at a steady size (insert one chat, evict one leaf).\n"
    )
    print(
        f"| cached nodes | build (s) | match, {HOT_SET} hot chats | match, any chat "
        "| insert | evict() of one leaf | bulk evict, per node |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size in (int(s) for s in args.sizes.split(",")):
        r = measure(size, args.ops)
        print(
            f"| {r['nodes']:,} | {r['build_s']:.1f} | {r['match_hot']:.2f} | {r['match']:.2f} "
            f"| {r['insert']:.2f} | {r['evict']:.2f} | {r['evict_bulk']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
