"""Images into the language model's input: mlx-vlm's processor and vision tower, beside
the mlx-lm language model the engine runs on its own batched cache path.

mlx-lm loads a vision model's folder as its language model alone (the towers dropped),
which is what the scheduler and generator already run, text-only requests unchanged. For
a prompt with images, mlx-vlm's own model computes the input embeddings (its
`get_input_embeddings`: the image's features scattered into its token span, scaled as
mlx-vlm scales them) with the language model's embedding table shared, not loaded twice;
its language layers are dropped before they are read. The engine's language model then
takes those embeddings (`input_embeddings`) for the chunks that hold image tokens, so the
forward is mlx_vlm.generate's, and every chunk with no image in it is fed as token ids.
For Qwen-VL, whose tokens have 3-D M-RoPE positions, mlx-vlm's `get_rope_index` places
the prompt and the language model's RoPE is made to follow (engine/mrope.py); the images'
patch grids it takes follow from their sizes (engine/qwen_resize.py), so the processor
runs only for the pixels the tower reads: once per image of a cold prompt, never for an
image the radix cache holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from engine.api import PromptImage, SchedulerCounters
from engine.image_files import open_image, rgb_pixels
from engine.image_tokens import ImageTokens, model_ids
from engine.mrope import MRoPE, Placement, PromptPositions
from engine.qwen_resize import QwenResize

# One image's pixels as the tower reads them: its processor's outputs (`pixel_values`, and
# Qwen-VL's `image_grid_thw`), as NumPy arrays.
Pixels = dict[str, np.ndarray]


def _mlx_vlm_utils():
    """mlx-vlm (the `vision` extra), imported once a vision model loads: a server of text
    models runs without it."""
    try:
        from mlx_vlm import utils
    except ImportError as error:
        raise RuntimeError("this is a vision model, and serving it needs mlx-vlm: "
                           "pip install 'radix-mlx[vision]'") from error
    return utils


class Vision:
    """A vision model's image side: its processor and its tower's features merged into
    the input embeddings."""

    def __init__(self, path: Path, language_model: nn.Module, images: ImageTokens) -> None:
        """The image side of the model folder at `path`, whose prompts hold `images`."""
        utils = _mlx_vlm_utils()
        model = utils.load_model(path, lazy=True)
        body = model.language_model.model
        # A family that places tokens with M-RoPE: its rotary embedding, before the layers
        # that hold it go, turns the engine's language model's RoPE into M-RoPE.
        self.mrope = (MRoPE(language_model, body.layers[0].self_attn.rotary_emb)
                      if hasattr(model.language_model, "get_rope_index") else None)
        body.embed_tokens = _embedding_table(language_model)
        body.layers = []  # the engine's language model runs them; never read here
        model.language_model.lm_head = None
        mx.eval(model.parameters())
        self.model = model
        self.image_processor = utils.load_processor(path, add_detokenizer=False).image_processor
        self.image_token_id = images.image_token_id
        self.resize = images.resize
        if self.resize is not None:
            _check_resize(self.resize, self.image_processor)
        self.weight_bytes = sum(
            v.nbytes for name, v in nn.utils.tree_flatten(model.parameters())
            if "embed_tokens" not in name)

    @property
    def code_version(self) -> str:
        """The code that turns an image into its features: mlx-vlm's vision tower, and
        the processor that makes its pixels (transformers' class, a fast one where
        torchvision is installed, and Pillow, which resizes). KV on disk that other code
        computed is not reused (`model_fingerprint`): an upgrade or a new package may
        change the pixels, or the math, of an image whose key stays the same."""
        import mlx_vlm
        import PIL
        import transformers

        return (f"mlx-vlm {mlx_vlm.__version__}, transformers {transformers.__version__} "
                f"{type(self.image_processor).__name__}, Pillow {PIL.__version__}")

    def pixels(self, data: bytes) -> Pixels:
        """The image file `data` decoded and run through the processor, alone: NumPy and
        Pillow only, no MLX, so the scheduler runs it on a thread of its own while streams
        decode (a 2-megapixel photo takes ~60 ms of CPU). Alone, so that an image's
        features never depend on the images sent beside it."""
        processed = self.image_processor([rgb_pixels(open_image(data))], return_tensors="np")
        return {key: np.asarray(processed[key]) for key in ("pixel_values", "image_grid_thw")
                if key in processed}

    def embeddings(self, tokens: Sequence[int], images: Sequence[Pixels]) -> mx.array:
        """The input embeddings of `tokens` (image keys in each image's span, as the
        tree holds them), with the features of the images whose `pixels` are `images`,
        in order, in the spans."""
        ids = mx.array([model_ids(tokens, self.image_token_id)])
        grids = ({"image_grid_thw": mx.array(np.concatenate(
            [image["image_grid_thw"] for image in images]))}
            if "image_grid_thw" in images[0] else {})
        values = np.concatenate([image["pixel_values"] for image in images])
        features = self.model.get_input_embeddings(
            ids, mx.array(values), mask=mx.ones(ids.shape), **grids)
        return features.inputs_embeds[0]

    def positions(self, tokens: Sequence[int], images: Sequence[PromptImage]
                  ) -> PromptPositions | None:
        """The M-RoPE positions of the prompt `tokens` (image keys in the spans) holding
        `images`, as mlx-vlm places them (None: the model places tokens at their index).
        Only the images' patch grids are needed, which their sizes give: nothing is
        decoded."""
        if self.mrope is None:
            return None
        ids = mx.array([model_ids(tokens, self.image_token_id)])
        grids = mx.array([[1, *self.resize.grid(image.file.size)] for image in images])
        grid, deltas = self.model.language_model.get_rope_index(ids, grids)
        return PromptPositions(grid[:, 0, :], deltas.item())


@dataclass(eq=False)
class ImageFeed:
    """A prompt's images as its prefill reads them: the embeddings from the first chunk
    that holds an image on to the prompt's end, computed once, when that chunk is fed.
    `pixels` holds, by index, the images the scheduler prepared before admission (those
    past the cached prefix it matched); any other one fed is prepared here."""

    vision: Vision
    images: tuple[PromptImage, ...]
    counters: SchedulerCounters
    pixels: dict[int, Pixels] = field(default_factory=dict)
    _start: int = 0  # where `_embeddings` start in the prompt
    _embeddings: mx.array | None = field(default=None, repr=False)
    _positions: PromptPositions | None = field(default=None, repr=False)

    def inputs(self, prompt: Sequence[int], start: int, end: int) -> mx.array | None:
        """Input embeddings of positions [start, end) of `prompt`, where an image is in
        them (None: text only, fed as ids)."""
        inside = [image for image in self.images
                  if image.start < end and start < image.start + image.length]
        if not inside:
            return None
        if self._embeddings is None or start < self._start:
            first = self.images.index(inside[0])
            self._start = min(start, inside[0].start)
            self._embeddings = self.vision.embeddings(
                prompt[self._start:],
                [self.pixels.get(index) or self.vision.pixels(self.images[index].file.data)
                 for index in range(first, len(self.images))])
            self.counters.images_encoded += len(self.images) - first
        embeddings = self._embeddings[start - self._start:end - self._start]
        last = self.images[-1]
        if end >= last.start + last.length:
            self._embeddings = None  # no image is left to feed
            self.pixels.clear()
        return embeddings

    def placement(self, prompt: Sequence[int], start: int, end: int) -> Placement | None:
        """Where positions [start, end) of `prompt` are rotated (None: at their index,
        for a family without M-RoPE). The prompt's positions are computed at the first
        call, which every prompt's prefill makes (its last token at least)."""
        if self.vision.mrope is None:
            return None
        if self._positions is None:
            self._positions = self.vision.positions(prompt, self.images)
        return self._positions.chunk(start, end)

    @property
    def rope_delta(self) -> int:
        """How far past its index each token after the prompt's images is rotated."""
        return 0 if self._positions is None else self._positions.rope_delta

    def model_ids(self, tokens: Sequence[int]) -> list[int]:
        return model_ids(tokens, self.vision.image_token_id)


def _check_resize(resize: QwenResize, processor: Any) -> None:
    """The server counts a Qwen-VL image's tokens, and `Vision.positions` places them, by
    the resize rule read from the model folder (engine/qwen_resize.py); the pixels are
    mlx-vlm's processor's, which read the folder its own way: a folder they read
    differently is refused here, not served with tokens that miss their features."""
    theirs = QwenResize(processor.patch_size, processor.merge_size, processor.min_pixels,
                        processor.max_pixels)
    if theirs != resize:
        raise RuntimeError(f"mlx-vlm's image processor sizes images as {theirs}, the "
                           f"model folder's settings read {resize}")


def _embedding_table(model: nn.Module) -> nn.Module:
    """The token embedding of an mlx-lm model: its language model's, for the vision
    families that nest one."""
    inner = getattr(model, "language_model", model)
    return inner.model.embed_tokens

