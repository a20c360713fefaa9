"""Grammars checked in a process of their own before anything compiles them here.

llguidance is native code, and a client's schema reaches it: 1.9 dies with SIGSEGV on
some integer ranges (engine/json_schemas.py refuses the one known). A grammar that kills
the checker's process costs its request a 400 and the next check a new process; compiled
in the server's process, it would cost every request in flight. A grammar is checked once
(`GrammarChecker.check` remembers its verdict), so an agent that sends the same tools with
every request pays the round trip once.
"""

from __future__ import annotations

import functools
import multiprocessing
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

from llguidance import LLMatcher, LLTokenizer

SPAWN = multiprocessing.get_context("spawn")  # a fork would copy the server's threads
# A check that takes longer is a grammar too costly to compile: refused, its process ended.
CHECK_SECONDS = 30.0
REMEMBERED = 512  # verdicts kept, most recently asked first


@dataclass(frozen=True)
class Verdict:
    """What llguidance makes of a grammar: its error (None: it compiles), and whether any
    output can start under it (a grammar that is only a rule referring to itself compiles,
    but admits no first byte)."""

    error: str | None
    can_start: bool = True


class GrammarChecker:
    """A child process that compiles grammars for their verdicts, started when first
    needed and again after one of them killed it. Thread-safe: checks go one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self.check = functools.lru_cache(maxsize=REMEMBERED)(self._check)

    def _check(self, grammar: str) -> Verdict:
        with self._lock:
            conn = self._started()
            try:
                conn.send(grammar)
                if conn.poll(CHECK_SECONDS):
                    return conn.recv()
                error = f"the grammar did not compile within {CHECK_SECONDS:g} s"
            except (EOFError, OSError):
                error = "the grammar crashed the grammar engine"
            self._stop()
            return Verdict(error)

    def _started(self) -> Connection:
        if self._process is None or not self._process.is_alive():
            self._conn, child = SPAWN.Pipe()
            self._process = SPAWN.Process(target=_serve, args=(child,),
                                          name="radix-mlx-grammar-check", daemon=True)
            self._process.start()
            child.close()  # the child's death must close the pipe
        return self._conn

    def _stop(self) -> None:
        self._process.kill()
        self._process.join()
        self._conn.close()
        self._process = self._conn = None


def _serve(conn: Connection) -> None:
    """The child: a verdict for each grammar sent, until the pipe closes."""
    tokenizer = LLTokenizer("byte")  # llguidance's tokenizer of single bytes
    while True:
        try:
            grammar = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_verdict(grammar, tokenizer))


def _verdict(grammar: str, tokenizer: LLTokenizer) -> Verdict:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return Verdict(messages[0] if messages else "invalid grammar")
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    matcher.compute_logit_bias()
    return Verdict(None, can_start=not matcher.is_error())


CHECKER = GrammarChecker()
