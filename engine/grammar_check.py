"""Grammars checked in a process of their own before anything compiles them here.

llguidance is native code, and a client's schema reaches it: 1.9 dies with SIGSEGV on
some integer ranges (engine/json_schemas.py refuses the one known). A grammar that kills
the checker's process costs its request a 400 and the next check a new process; compiled
in the server's process, it would cost every request in flight. A grammar is checked once
(`GrammarChecker.check` remembers its verdict), so an agent that sends the same tools with
every request pays the round trip once.

llguidance also recurses on a grammar's nesting as it compiles it (a chain of ~2,700 lark
rules, each naming the next, needs 8 MiB of stack). The checker compiles on a thread of
`CHECK_STACK_BYTES`, a quarter of the stack the engine gives the threads that compile and
run grammars (`GRAMMAR_THREAD_STACK_BYTES`): a grammar that passes here has room there.

The checker is `python -m engine.grammar_check`, as `ps` shows it: one grammar a line on
its stdin (JSON), one verdict a line on its stdout. It exits when its stdin closes.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

from llguidance import LLMatcher, LLTokenizer

# A check that takes longer is a grammar too costly to compile: refused, its process ended.
CHECK_SECONDS = 30.0
REMEMBERED = 512  # verdicts kept, most recently asked first
GRAMMAR_THREAD_STACK_BYTES = 16 * 2**20
CHECK_STACK_BYTES = GRAMMAR_THREAD_STACK_BYTES // 4
CRASHED = "the grammar crashed the grammar engine"
# Where `engine` is importable from, for a checkout that is not installed.
SOURCE_ROOT = str(Path(__file__).resolve().parents[1])


@dataclass(frozen=True)
class Verdict:
    """What llguidance makes of a grammar: its error (None: it compiles), and whether any
    output can start under it (a grammar that is only a rule referring to itself compiles,
    but admits no first byte)."""

    error: str | None
    can_start: bool = True


class GrammarChecker:
    """The checker's process, started when first needed and again after a grammar killed
    it. Thread-safe: checks go one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        # Verdicts by the grammar's digest, not its text: a schema's text (descriptions
        # and all) can be megabytes, and 512 of them held 2 GB.
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()

    def check(self, grammar: str) -> Verdict:
        key = hashlib.blake2b(grammar.encode(), digest_size=32).digest()
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
                return verdict
            verdict = self._verdicts[key] = self._ask(grammar)
            if len(self._verdicts) > REMEMBERED:
                self._verdicts.popitem(last=False)
            return verdict

    def _ask(self, grammar: str) -> Verdict:
        process = self._started()
        try:
            process.stdin.write(json.dumps(grammar) + "\n")
            process.stdin.flush()
            if select.select([process.stdout], [], [], CHECK_SECONDS)[0]:
                if line := process.stdout.readline():
                    return Verdict(**json.loads(line))
                error = CRASHED
            else:
                error = f"the grammar did not compile within {CHECK_SECONDS:g} s"
        except OSError:  # the pipe broke: it died
            error = CRASHED
        self._stop()
        return Verdict(error)

    def _started(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            path = os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))
            # A session of its own: a terminal's Ctrl+C or close, which signals the
            # server's process group, would kill it under a draining server's requests.
            # It ends when its stdin closes, the server gone.
            self._process = subprocess.Popen(
                [sys.executable, "-m", "engine.grammar_check"], text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": path}, start_new_session=True)
        return self._process

    def _stop(self) -> None:
        self._process.kill()
        self._process.wait()
        self._process = None


def verdict(grammar: str, tokenizer: LLTokenizer) -> Verdict:
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return Verdict(messages[0] if messages else "invalid grammar")
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    matcher.compute_logit_bias()
    if matcher.is_error():
        return Verdict(None, can_start=False)
    # What it forces from the start, taken in as if written: a required property whose
    # value is its own object type forces an output without end, which llguidance's
    # limits stop here rather than when the model's grammar is made (a 400, not an
    # error inside a stream that has begun).
    matcher.consume_tokens(matcher.compute_ff_tokens())
    if matcher.is_error():
        return Verdict("the output it forces from the start (a long fixed text, or a "
                       "required property of its own object type, which never ends) exceeds "
                       "the grammar engine's limits: "
                       f"{matcher.get_error().splitlines()[0]}")
    return Verdict(None)


CHECKER = GrammarChecker()


def _serve() -> None:
    tokenizer = LLTokenizer("byte")  # llguidance's tokenizer of single bytes
    for request in sys.stdin:
        print(json.dumps(asdict(verdict(json.loads(request), tokenizer))), flush=True)


if __name__ == "__main__":
    threading.stack_size(CHECK_STACK_BYTES)
    checks = threading.Thread(target=_serve, name="radix-mlx-grammar-check")
    checks.start()
    checks.join()
