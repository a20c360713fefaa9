"""Where `serve` logs: a file reopened after rotation, or stderr. Set up in the server's
process and again in its engine's (engine/process.py), with the same handler. A native
crash (a segfault in a library) writes every thread's Python stack to stderr, which the
service files keep, so that it does not end the process without a word."""

from __future__ import annotations

import faulthandler
import logging
import sys
import time
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
    logging.getLogger("asyncio").addFilter(_AcceptFailures())


class _AcceptFailures(logging.Filter):
    """At most one of asyncio's 'socket.accept() out of system resource' a minute. Out of
    file descriptors, its accept loop logs a traceback for each of up to a backlog's
    (2,048) waiting connections, every second: 184 MB of log in 30 s of a flood."""

    def __init__(self) -> None:
        super().__init__()
        self._last = -ACCEPT_FAILURE_LOG_SECONDS

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("socket.accept() out of system resource"):
            return True
        now = time.monotonic()
        if now - self._last < ACCEPT_FAILURE_LOG_SECONDS:
            return False
        self._last = now
        return True


ACCEPT_FAILURE_LOG_SECONDS = 60.0
