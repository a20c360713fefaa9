"""Where radix-mlx keeps its files, and publishing a model directory atomically, so a
reader never sees a half-written one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import platformdirs


def cache_dir(kind: str) -> Path:
    """The user cache directory for one kind of file: ~/.cache/radix-mlx/<kind> on Linux,
    ~/Library/Caches/radix-mlx/<kind> on macOS."""
    return Path(platformdirs.user_cache_dir("radix-mlx")) / kind


# The disk tier's default budget: this share of the free space where the cache lives, at
# most the cap.
DEFAULT_DISK_FRACTION = 0.25
DEFAULT_DISK_CAP_BYTES = 64 * 2**30


def default_disk_budget(directory: Path) -> int:
    """A share of the free space on the cache's file system, capped."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    return int(min(free * DEFAULT_DISK_FRACTION, DEFAULT_DISK_CAP_BYTES))


def publish_directory(path: Path, write: Callable[[Path], None], replace: bool) -> None:
    """Run `write` on a staging directory beside `path`, then rename it to `path`.

    Staging beside the target keeps the rename on one filesystem, hence atomic. Without
    `replace`, concurrent writers may race: the first rename wins and the others discard
    their copies (the target then exists and is complete).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    staging.chmod(0o755)  # mkdtemp's 0o700 would hide a shared model from other users
    try:
        write(staging)
        if replace and path.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, retired / path.name)
            shutil.rmtree(retired)
        try:
            os.rename(staging, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
