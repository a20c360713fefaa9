"""What a vision model's prompt says of images, without MLX: the placeholder its chat
template writes, the token run its processor expands it into, and the radix keys of those
runs.

An image's tokens are all one placeholder id in the model's input, so a radix tree keyed on
input ids would match any image against any other. As SGLang does, the run is keyed on the
image instead: every position holds `key_id(digest)`, an id past every vocabulary derived
from a digest of the decoded pixels and the processor's settings. The same image (the same
pixels, however encoded) matches; another never does. The engine puts the real ids and the
image's features back at the model's boundary (engine/vision.py).

Gemma 3 gives every image the same number of tokens; Qwen2-VL and Qwen2.5-VL give each as
many as its resized pixels make patches (2x2 merges of 14-pixel patches), which follows
from the image's decoded size by the processor's resize rule (engine/qwen_resize.py), so
the prompt is expanded with each image's count, and no image is decoded to count it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.api import ImageFile, PromptImage
from engine.qwen_resize import QwenResize, read_resize

# Key ids start here, past any vocabulary. A key is never fed to the model (`model_ids`
# puts the image token back; drafts stop before one), so it need not fit MLX's int32 ids:
# it takes KEY_BITS of the digest, and with the base stays inside the disk tier's int64.
# With 30 bits, as it once had, two different images made to share a key in under a
# second shared their KV: the second answered with the first image's answer.
KEY_BASE = 1 << 30
KEY_BITS = 60


@dataclass(frozen=True)
class Family:
    """How a vision family's config names its image tokens, and how its template and
    processor frame an image: the template writes `placeholder` (a format of the tokens
    `begin`, `image` and `end`), the processor expands it into `margin` + `begin` +
    `image` x count + `end` + `margin`."""

    begin_key: str  # config keys of the start-of-image, image and end-of-image token ids
    image_key: str
    end_key: str
    placeholder: str
    margin: str
    sized: bool  # each image's count of tokens follows from its size (else fixed)


# The families whose image tokens this server places and whose language model runs on our
# cache path as it does in mlx-vlm (Qwen-VL's 3-D M-RoPE positions: engine/mrope.py).
FAMILIES = {
    "gemma3": Family("boi_token_index", "image_token_index", "eoi_token_index",
                     placeholder="{begin}", margin="\n\n", sized=False),
    **{model_type: Family("vision_start_token_id", "image_token_id", "vision_end_token_id",
                          placeholder="{begin}{image}{end}", margin="", sized=True)
       for model_type in ("qwen2_vl", "qwen2_5_vl")},
}

# Where an image goes in a message's text: the front ends put one here per image, and the
# rendered prompt's markers become the model's image tokens (`ImageTokens.expand`), so a
# placeholder a client typed as text (engine/control_tokens.py breaks it) places no image.
# A private-use character before the object replacement character: text pasted from a
# rich-text editor holds the latter alone (where an attachment was), which, as the marker
# once, placed an image there or refused a text chat with no image; no text holds the pair
# by accident.
MARKER = "\U000f0000\ufffc"

# Files whose settings change the pixels a processor gives the vision tower.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True)
class ImageTokens:
    """How this model's prompts hold images."""

    placeholder: str  # what the chat template writes for an image
    before: str  # what the processor puts before an image's tokens, and after them
    image: str  # the text of one image token
    after: str
    image_token_id: int  # the id of each of the image's tokens in the model's input
    settings: str  # a digest of the processor's settings, part of every image's digest
    tokens_per_image: int | None  # every image's number of tokens, where it is fixed
    resize: QwenResize | None  # else the processor's resize rule, which sizes each image

    def count(self, size: tuple[int, int]) -> int:
        """The number of tokens of an image of decoded `size` (width, height); ValueError
        where the processor refuses it (Qwen's: a side under 1/200 of the other)."""
        return self.tokens_per_image if self.resize is None else self.resize.count(size)

    def expansion(self, count: int) -> str:
        """What the processor replaces a placeholder with: an image of `count` tokens."""
        return f"{self.before}{self.image * count}{self.after}"

    def expand(self, text: str, counts: Sequence[int]) -> str:
        """`text` with its `MARKER`s expanded, the i-th into `counts[i]` image tokens;
        markers past `counts` stay as they are (`key` then finds too few images)."""
        pieces = text.split(MARKER)
        expanded = [pieces[0]]
        for index, piece in enumerate(pieces[1:]):
            expanded.append(self.expansion(counts[index]) if index < len(counts) else MARKER)
            expanded.append(piece)
        return "".join(expanded)

    def collapse(self, text: str) -> str:
        """`text` (a decoded prompt) with each expanded image back to its placeholder: what
        mlx-vlm's processor takes."""
        pattern = f"{re.escape(self.before)}(?:{re.escape(self.image)})+{re.escape(self.after)}"
        return re.sub(pattern, lambda _: self.placeholder, text)

    def spans(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """(start, length) of each run of image tokens in `tokens`, in order."""
        if self.image_token_id not in tokens:  # a text prompt: one pass at C speed
            return []
        spans: list[tuple[int, int]] = []
        start = None
        for position, token in enumerate([*tokens, -1]):
            if token == self.image_token_id and start is None:
                start = position
            elif token != self.image_token_id and start is not None:
                spans.append((start, position - start))
                start = None
        return spans


    def model_ids(self, tokens: Sequence[int]) -> list[int]:
        return model_ids(tokens, self.image_token_id)

    def key(self, tokens: Sequence[int], images: Sequence[ImageFile]
            ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """`tokens` with each image's span keyed on its digest, and the prompt's images;
        `images`: in the order the prompt shows them. Raises ValueError when the prompt
        holds another number of images."""
        spans = self.spans(tokens)
        if len(spans) != len(images):
            raise ValueError(f"the prompt holds {len(spans)} images, the request "
                             f"{len(images)}")
        keyed = list(tokens)
        for (start, length), image in zip(spans, images):
            keyed[start:start + length] = [key_id(image.digest)] * length
        return keyed, tuple(PromptImage(start, length, image)
                            for (start, length), image in zip(spans, images))


def key_id(digest: str) -> int:
    """The radix key of every token of the image with `digest` (hex): two images share
    one with a chance of 2^-60, a million cached images with one of ~10^-6."""
    return KEY_BASE + (int(digest, 16) >> (4 * len(digest) - KEY_BITS))


def model_ids(tokens: Sequence[int], image_token_id: int) -> list[int]:
    """`tokens` as the model reads them: each image key back to the image token."""
    return [image_token_id if token >= KEY_BASE else token for token in tokens]


def text_ids(tokens: Sequence[int]) -> list[int]:
    """`tokens` without image keys: what decodes to the prompt's text."""
    return [token for token in tokens if token < KEY_BASE]


def read_image_tokens(path: Path, decode: Callable[[list[int]], str]) -> ImageTokens | None:
    """The image tokens of the model folder at `path` (its tokenizer's `decode`), if it is
    a vision model of a family in `FAMILIES` (None: text only)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    family = FAMILIES.get(config.get("model_type"))
    keys = (family.begin_key, family.image_key, family.end_key) if family else ()
    if family is None or "vision_config" not in config or any(k not in config for k in keys):
        return None
    begin, image, end = (decode([config[key]]) for key in keys)
    preprocessor, processor = (_json(path / name) for name in PROCESSOR_FILES)
    settings = hashlib.sha256()
    for contents in (preprocessor, processor):
        settings.update(json.dumps(contents, sort_keys=True).encode())
    fixed = None if family.sized else (processor.get("image_seq_length")
                                       or config.get("mm_tokens_per_image", 256))
    return ImageTokens(
        placeholder=family.placeholder.format(begin=begin, image=image, end=end),
        before=family.margin + begin, image=image, after=end + family.margin,
        image_token_id=config[family.image_key], settings=settings.hexdigest(),
        tokens_per_image=fixed,
        resize=read_resize(preprocessor, processor) if family.sized else None)


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
