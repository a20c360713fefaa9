"""How long a running stream stands still while new photos arrive, in process.

    python bench/experiments/image-prep-off-thread/stall.py [--size bench] [--photos 6]

One greedy text stream decodes on the demo Gemma 3 vision model (engine/demo_vlm.py) while
`photos` requests, each with a new 1600x1200 JPEG, come in one after another. Prints the
text stream's inter-token gaps (median, p99, max) and each photo's time to first token.
Run at f70dce1 (images prepared off the engine's thread) and at its parent.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from engine.api import Finish, SamplingParams, TokenEvent
from engine.demo_vlm import build_demo_vlm
from engine.engine import Engine, EngineConfig
from tests.vision.support import image_prompt, user_turn


def photo(seed: int) -> bytes:
    """A photo-like JPEG: gradients and noise, 1600x1200, ~1 MB."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:1200, 0:1600]
    pixels = np.stack([x / 1600 * 255, y / 1200 * 255, (x + y + seed) % 256], -1)
    pixels = (pixels + rng.normal(0, 20, pixels.shape)).clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--photos", type=int, default=6)
    args = parser.parse_args()
    folder = build_demo_vlm(Path(tempfile.mkdtemp()) / "vlm", size=args.size)
    engine = Engine(EngineConfig(model=str(folder), cache_bytes=1 << 30))
    engine.start()
    assert engine.wait_ready(300) == "ready", engine.error
    tokenizer = engine.tokenizer
    # Made before the stream starts: on this loop they would stall its reader.
    prompts = [image_prompt(tokenizer, [user_turn(tokenizer)], [photo(seed)])
               for seed in range(args.photos)]
    text = tokenizer.chat_prompt([{"role": "user", "content": "Count to a thousand."}])
    running = engine.submit(text, SamplingParams(max_tokens=8000, temperature=0.0,
                                                 ignore_eos=True))
    arrivals: list[float] = []

    async def read_text() -> None:
        async for event in running:
            if isinstance(event, TokenEvent):
                arrivals.append(time.perf_counter())

    reader = asyncio.create_task(read_text())
    await asyncio.sleep(1.0)
    start = len(arrivals)
    ttfts = []
    for prompt in prompts:
        sent = time.perf_counter()
        async for event in engine.submit(prompt, SamplingParams(max_tokens=1)):
            if isinstance(event, TokenEvent | Finish):
                ttfts.append(time.perf_counter() - sent)
                break
        await asyncio.sleep(0.2)
    running.cancel()
    await reader
    engine.shutdown()
    gaps = sorted(1e3 * (b - a) for a, b in zip(arrivals[start:], arrivals[start + 1:],
                                                strict=False))
    print(f"text stream gaps over {len(gaps)} tokens: median {statistics.median(gaps):.1f} ms, "
          f"p99 {gaps[int(0.99 * len(gaps))]:.1f} ms, max {gaps[-1]:.1f} ms")
    print("photo TTFT ms:", [round(1e3 * t) for t in ttfts])


asyncio.run(main())
