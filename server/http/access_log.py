"""The one access-log line per request, with what the engine did for it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from urllib.parse import quote

access_log = logging.getLogger("radix_mlx.access")

# What a logged path keeps as it is: RFC 3986's path characters. Anything else (a line
# break, a NUL, a space, non-ASCII) is percent-encoded again, as the client sent it, so a
# URL cannot write lines of its own into the log.
PATH_CHARACTERS = "/:@!$&'()*+,;=-._~"


@dataclass
class RequestStats:
    """What the access log reports about one request; its job fills it in."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cache_miss: str | None = None  # "<reason>@<position>" of the first prompt token not reused
    # Speculative decoding: tokens drafted for it, and those accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


def log_request(
    request_id: str, method: str, path: str, status: int, started_at: float,
    stats: RequestStats | None,
) -> None:
    end = time.perf_counter()
    fields = "prompt=- cached=- miss=- completion=- ttft_ms=- tok/s=- accept=- tok/step=-"
    if stats is not None:
        ttft = tok_s = "-"
        if stats.first_token_at is not None:
            ttft = f"{(stats.first_token_at - started_at) * 1000:.1f}"
            decode = (stats.last_token_at or end) - stats.first_token_at
            if stats.completion_tokens > 1 and decode > 0:
                tok_s = f"{(stats.completion_tokens - 1) / decode:.1f}"
        accept = per_step = "-"
        if stats.draft_tokens:
            # Every decode step outputs one token beside the draft tokens it accepted.
            steps = stats.completion_tokens - stats.accepted_draft_tokens
            accept = f"{stats.accepted_draft_tokens / stats.draft_tokens:.2f}"
            per_step = f"{stats.completion_tokens / max(steps, 1):.2f}"
        fields = (f"prompt={stats.prompt_tokens} cached={stats.cached_tokens} "
                  f"miss={stats.cache_miss or '-'} "
                  f"completion={stats.completion_tokens} ttft_ms={ttft} tok/s={tok_s} "
                  f"accept={accept} tok/step={per_step}")
    access_log.info(
        "%s %s %s %d %s duration_ms=%.1f", request_id, method,
        quote(path, safe=PATH_CHARACTERS), status, fields,
        (end - started_at) * 1000,
    )
