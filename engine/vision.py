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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path

import mlx.core as mx
from mlx import nn

from engine.api import PromptImage, SchedulerCounters
from engine.image_tokens import model_ids


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

    def __init__(self, path: Path, language_model: nn.Module, image_token_id: int) -> None:
        utils = _mlx_vlm_utils()
        model = utils.load_model(path, lazy=True)
        body = model.language_model.model
        body.embed_tokens = _embedding_table(language_model)
        body.layers = []  # the engine's language model runs them; never read here
        model.language_model.lm_head = None
        mx.eval(model.parameters())
        self.model = model
        self.image_processor = utils.load_processor(path, add_detokenizer=False).image_processor
        self._load_image = utils.load_image
        self.image_token_id = image_token_id
        self.weight_bytes = sum(
            v.nbytes for name, v in nn.utils.tree_flatten(model.parameters())
            if "embed_tokens" not in name)

    def embeddings(self, tokens: Sequence[int], images: Sequence[bytes]) -> mx.array:
        """The input embeddings of `tokens` (image keys in each image's span, as the
        tree holds them), with `images`' features, in order, in the spans."""
        pictures = [self._load_image(BytesIO(data)) for data in images]
        pixels = self.image_processor(pictures, return_tensors="np")["pixel_values"]
        ids = mx.array([model_ids(tokens, self.image_token_id)])
        features = self.model.get_input_embeddings(ids, mx.array(pixels), mask=mx.ones(ids.shape))
        return features.inputs_embeds[0]


@dataclass(eq=False)
class ImageFeed:
    """A prompt's images as its prefill reads them: the embeddings from the first chunk
    that holds an image on to the prompt's end, computed once, when that chunk is fed."""

    vision: Vision
    images: tuple[PromptImage, ...]
    counters: SchedulerCounters
    _start: int = 0  # where `_embeddings` start in the prompt
    _embeddings: mx.array | None = field(default=None, repr=False)

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
                prompt[self._start:], [image.data for image in self.images[first:]])
            self.counters.images_encoded += len(self.images) - first
        embeddings = self._embeddings[start - self._start:end - self._start]
        last = self.images[-1]
        if end >= last.start + last.length:
            self._embeddings = None  # no image is left to feed
        return embeddings

    def model_ids(self, tokens: Sequence[int]) -> list[int]:
        return model_ids(tokens, self.vision.image_token_id)


def _embedding_table(model: nn.Module) -> nn.Module:
    """The token embedding of an mlx-lm model: its language model's, for the vision
    families that nest one."""
    inner = getattr(model, "language_model", model)
    return inner.model.embed_tokens

