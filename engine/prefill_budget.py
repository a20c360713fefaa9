"""How many prompt tokens a step may prefill while other requests decode: a time budget.

A step runs the decode batch, then a chunk of some prompt. Every second the chunk takes is
a second each running stream waits for its next token, so the chunk is sized by time, not
by a fixed token count: each decoding step earns the prefill an allowance of
`stall_ratio` times a decode step's cost (at least `stall_floor` seconds), and a chunk
spends what it took. So, averaged over steps, prefill lengthens the streams' steps by at
most that share, whatever the device, model, batch or context length.

Both costs are measured as the engine runs (whole steps' wall time: steps with no
prefill give the decode cost, the rest the cost per prompt token), each the lowest of its
recent samples, so the budget follows the batch as it grows and its contexts as they
lengthen, and a step slowed by what is not its own work does not skew it. Such steps are
common and slow only ever: a kernel compiled for a shape met the first time, a batch
join, a buffer cache refill. On an H100 one cold 752-token prefill measured 4.2 ms a
token against a real ~0.07; a moving average of it starved prefill for dozens of steps
(64 streams arriving at once waited 14 s for their first tokens instead of 0.3-0.5 s).
A chunk is at least `granule` tokens (or what is left of the prompts): a forward pass
has a fixed cost, so small chunks cost more per token; instead the allowance accrues over
steps until it pays for a chunk, and the measured cost of what ran is what is spent, so an
estimate that is off is corrected by the next steps. Chunk sizes are multiples of the
granule, so the shapes a forward pass sees stay few.
"""

from __future__ import annotations

from collections import deque

# Recent samples a cost is the lowest of: a slow outlier ages out in this many samples,
# and a real rise in cost (a longer context, a bigger batch) is followed as soon.
WINDOW = 8
# Prompt tokens a chunk comes in multiples of (and at least, unless less is left to
# prefill or the chunk limit is smaller). On the 2-core CPU (143M float32) chunks of 64,
# 128 and 256 tokens cost ~15, ~11 and ~8.6 ms a token: prompt tokens far outnumber
# generated ones in shared-prefix traffic, so 64-token chunks cost a third of the
# throughput (measured: 84 s became 130 s for the same 32 requests).
GRANULE = 256


class RecentLow:
    """The lowest of the last `WINDOW` samples (None before the first)."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=WINDOW)

    def add(self, sample: float) -> None:
        self._samples.append(sample)

    @property
    def value(self) -> float | None:
        return min(self._samples) if self._samples else None


class PrefillBudget:
    """Sizes each step's prefill from costs measured online; see the module docstring."""

    def __init__(self, stall_ratio: float, stall_floor: float, chunk: int,
                 idle_chunk: int) -> None:
        self.stall_ratio = stall_ratio
        self.stall_floor = stall_floor  # seconds
        self.chunk = chunk  # the most tokens a step prefills while others decode
        self.idle_chunk = idle_chunk  # ... and while nothing decodes
        self.granule = min(GRANULE, chunk)
        self._decode = RecentLow()  # a step with no prefill in it
        self._token = RecentLow()  # one prompt token of a chunk
        self.credit = 0.0  # seconds of stall the prefill may still spend

    @property
    def decode_seconds(self) -> float | None:
        return self._decode.value

    @property
    def token_seconds(self) -> float | None:
        return self._token.value

    def tokens(self, decoding: bool, waiting: int) -> int:
        """Prompt tokens this step may prefill (0: none this step, the allowance accrues),
        `waiting` being how many the prompts being prefilled still need."""
        if not decoding:
            self.credit = 0.0  # nobody waits on this step; start afresh when someone does
            return self.idle_chunk
        decode_seconds = self.decode_seconds
        if decode_seconds is None:
            return 0  # measure a decode step first
        allowance = max(self.stall_ratio * decode_seconds, self.stall_floor)
        token_seconds = self.token_seconds or 0.0
        # Unspent allowance is kept up to what the largest chunk costs, no more: a stall
        # saved up over a long quiet spell would come out as one long stall.
        self.credit = min(self.credit + allowance,
                          max(allowance, self.chunk * token_seconds))
        wanted = min(waiting, self.chunk)
        affordable = min(int(self.credit / token_seconds), self.chunk) if token_seconds \
            else wanted
        if affordable >= wanted:
            return wanted  # what is left of the prompts, short ones in one forward
        return affordable - affordable % self.granule if affordable >= self.granule else 0

    def record(self, decoding: bool, prefilled: int, seconds: float) -> None:
        """A step took `seconds`; it decoded or not, and prefilled `prefilled` tokens."""
        if prefilled == 0:
            if decoding:
                self._decode.add(seconds)
            return
        stall = seconds - (self.decode_seconds or 0.0) if decoding else seconds
        if decoding:
            self.credit -= stall
        # A prompt's last few tokens carry a whole chunk's fixed cost: not a fair sample.
        if prefilled >= self.granule // 4:
            self._token.add(max(stall, 0.0) / prefilled)
