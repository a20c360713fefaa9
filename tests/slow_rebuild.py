"""`python -m tests.slow_rebuild SECONDS [serve flags]` is `python -m server [serve flags]`
whose disk tier takes SECONDS longer to rebuild its tree at start, as a tier of many
files does: a window in which to stop the server while it restores."""

from __future__ import annotations

import sys
import time

from engine.disk_store import DiskStore

rebuild_tree = DiskStore._rebuild


def slow_rebuild(store: DiskStore, tree, restore) -> int:
    time.sleep(float(sys.argv[1]))
    return rebuild_tree(store, tree, restore)


DiskStore._rebuild = slow_rebuild

if __name__ == "__main__":
    from server.launch.cli import run

    run(["serve", *sys.argv[2:]])
