"""The asyncio loop's busy samples of a py-spy raw profile, by cause.

    py-spy record --pid SERVER --threads --format raw --rate 250 --duration 40 -o RAW
    python loop_profile.py RAW SERVER_PID

Each sample of the loop (the server's main thread) that is not waiting in its selector
goes to the first cause whose frame it holds, in the order below (a socket write is
counted as the write, not as the send wrappers above it). py-spy sees a thread waiting
for the GIL as running, so shares include some of that wait.
"""

import collections
import sys
from pathlib import Path

CAUSES = [
    ("socket write (send syscall; releases the GIL)", ["_SelectorSocketTransport.write"]),
    ("HTTP framing: uvicorn send + h11/httptools", ["RequestResponseCycle.send"]),
    ("ASGI send wrappers (Starlette's two, ours)", ["send_with_id", ".sender (", "._send ("]),
    ("relay + RequestStream", ["LoopRelay.", "RequestStream."]),
    ("Prometheus ITL/TTFT observe", ["Histogram.observe"]),
    ("Job.events (usage, token accounting)", ["Job."]),
    ("ChoiceDecoder (reasoning/tools split)", ["ChoiceDecoder."]),
    ("chunk JSON (cached envelope)", ["chunk_json"]),
    ("SSE framing", ["frame (server/streaming"]),
    ("async-generator chain (_sse, GenerationRun.events)", ["_sse (", "GenerationRun.events"]),
    ("access log line", ["log_request"]),
    ("request admission (JSON, pydantic, FastAPI, render, submit)",
     ["with_json_request", "get_request_handler", "create_chat_completion"]),
    ("GenerationEventSource (rest)", ["GenerationEventSource."]),
]
REST = "asyncio loop and task switching, other"


def main() -> None:
    raw, pid = Path(sys.argv[1]), sys.argv[2]
    samples: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")[1:]
        if not stack.startswith(f"thread ({pid})") or not frames:
            continue
        if "select (selectors.py" in frames[-1]:
            continue  # idle
        cause = next((name for name, keys in CAUSES
                      if any(key in frame for frame in frames for key in keys)), REST)
        samples[cause] += int(count)
    busy = sum(samples.values())
    print(f"{busy} busy samples\n\n| cause | % of busy |\n|---|---:|")
    for name in [*(name for name, _ in CAUSES), REST]:
        print(f"| {name} | {100 * samples[name] / busy:.1f} |")


if __name__ == "__main__":
    main()
