"""Images and prompts for the vision tests, and mlx-vlm's own generation to compare with."""

from __future__ import annotations

import base64
import io
import struct
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from engine.api import ImageFile, Prompt
from engine.image_tokens import MARKER
from engine.tokenizer import ModelTokenizer
from server.images import checked_image

QUESTION = "What is in this picture?"


def png(seed: int, size: tuple[int, int] = (40, 48)) -> bytes:
    """A PNG of random pixels, one per seed."""
    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_prompt(tokenizer: ModelTokenizer, messages: list[dict], images: list[bytes],
                 message_ends: bool = False) -> Prompt:
    """The prompt the server builds for `messages` (an image `MARKER` in their text), with
    where each message ends when asked (a snapshot model's)."""
    files = [image_file(tokenizer, data) for data in images]
    counts = [tokenizer.images.count(file.size) for file in files]
    tokens = tokenizer.chat_prompt(messages, image_counts=counts)
    ends = ()
    if message_ends:
        heads = [messages[:count] for count in range(1, len(messages) + 1)]
        ends = tokenizer.shared_lengths(tokens, heads, image_counts=counts)
    keyed, prompt_images = tokenizer.images.key(tokens, files)
    return Prompt(keyed, ends, prompt_images)


def image_file(tokenizer: ModelTokenizer, data: bytes) -> ImageFile:
    """The image file `data` as the server loads it for the model of `tokenizer`."""
    return checked_image(data, 1 << 30, tokenizer.images.settings)


def image_count(tokenizer: ModelTokenizer, data: bytes) -> int:
    """How many tokens the server gives the image file `data`."""
    return tokenizer.images.count(image_file(tokenizer, data).size)


def prompt_text(tokenizer: ModelTokenizer, tokens: list[int]) -> str:
    """A prompt's text as mlx-vlm's processor takes it: image placeholders unexpanded."""
    images = tokenizer.images
    return images.collapse(tokenizer.decode(images.model_ids(tokens)))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def user_turn(tokenizer: ModelTokenizer, text: str = QUESTION) -> dict:
    return {"role": "user", "content": MARKER + text}


class VlmReference:
    """mlx_vlm.generate on the same folder: the ground truth for image prompts."""

    def __init__(self, path: Path | str) -> None:
        from mlx_vlm import load

        self.model, self.processor = load(str(path))

    def greedy(self, text: str, images: list[bytes], max_tokens: int) -> list[int]:
        from mlx_vlm import generate

        with tempfile.TemporaryDirectory() as folder:
            files = []
            for index, data in enumerate(images):
                files.append(str(Path(folder) / f"{index}.png"))
                Path(files[-1]).write_bytes(data)
            result = generate(self.model, self.processor, text, image=files or None,
                              max_tokens=max_tokens, temperature=0.0, verbose=False)
        return list(result.token_ids)


def webp_hiding_a_photocd(image: Image.Image, shade: int) -> bytes:
    """`image` as a lossless WebP that also holds a Kodak PhotoCD picture of one `shade`,
    in a chunk WebP readers skip: a reader that tries every format Pillow knows finds
    PhotoCD's signature at byte 2048 and decodes a 768x512 picture instead."""
    out = io.BytesIO()
    image.save(out, format="WEBP", lossless=True)
    body = out.getvalue()[12:]  # after RIFF, its size and WEBP
    start = 12 + len(body) + 8  # where the new chunk's data begins
    assert start < 2048, "a WebP small enough to end before PhotoCD's signature"
    data = bytes(2048 - start) + b"PCD_IPI" + bytes(1539 - 7)
    data += bytes(96 * 2048 - (start + len(data))) + bytes([shade]) * (768 * 512 * 2)
    body += b"ZZZZ" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(body)) + b"WEBP" + body
