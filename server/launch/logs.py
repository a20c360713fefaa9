"""Where `serve` logs: a file reopened after rotation, or stderr. Set up in the server's
process and again in its engine's (engine/process.py), with the same handler. A native
crash (a segfault in a library) writes every thread's Python stack to stderr, which the
service files keep, so that it does not end the process without a word."""

from __future__ import annotations

import faulthandler
import logging
import sys
from logging.handlers import WatchedFileHandler
from pathlib import Path

from server.launch.env import in_launch, launch_rank


def configure_logging(level: str, log_file: Path | None) -> None:
    faulthandler.enable()
    if log_file is not None:
        # launchd creates no directories for us; a missing one must not stop the service.
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = WatchedFileHandler(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    # Ranks of a tensor-parallel launch share one output: each line says whose it is.
    rank = f" rank {launch_rank()}" if in_launch() else ""
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s{rank} %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
