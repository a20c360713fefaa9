"""Qwen-VL's image resize rule, without MLX: from an image's decoded size alone, the size
its processor resizes it to, hence its patch grid and its number of tokens.

mlx-vlm's numpy Qwen2-VL / Qwen2.5-VL processor resizes each image with HF's
`smart_resize` (mlx-vlm's `_smart_resize_image`): each side rounded to a multiple of
patch x merge, then scaled, aspect kept, into [min_pixels, max_pixels]; an image whose
sides differ by more than 200x is refused. The image is then cut into patches, and each
merge x merge of them becomes one token. Computing that from the size lets the server
count an image's tokens without decoding it again, and the engine place a prompt's
positions without running the processor; `Vision` checks at load that its processor has
the settings read here (engine/vision.py), and tests/vision/test_resize.py that the grids
are the processor's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_ASPECT = 200


@dataclass(frozen=True)
class QwenResize:
    """The settings of a Qwen-VL processor that size an image; the defaults are mlx-vlm's
    for both families."""

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of patches of an image of `size` (width, height), as decoded;
        ValueError where the processor refuses it."""
        width, height = size
        if max(height, width) / min(height, width) > MAX_ASPECT:
            raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT}, got "
                             f"{max(height, width) / min(height, width)}")
        factor = self.patch_size * self.merge_size
        rows, columns = round(height / factor) * factor, round(width / factor) * factor
        if rows * columns > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            rows = max(factor, math.floor(height / beta / factor) * factor)
            columns = max(factor, math.floor(width / beta / factor) * factor)
        elif rows * columns < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            rows = math.ceil(height * beta / factor) * factor
            columns = math.ceil(width * beta / factor) * factor
        return rows // self.patch_size, columns // self.patch_size

    def count(self, size: tuple[int, int]) -> int:
        """The number of tokens an image of `size` (width, height) becomes."""
        rows, columns = self.grid(size)
        return rows * columns // self.merge_size ** 2


def read_resize(preprocessor: dict, processor: dict) -> QwenResize:
    """The resize settings of a Qwen-VL model folder whose preprocessor_config.json and
    processor_config.json hold `preprocessor` and `processor`, read as mlx-vlm reads them
    (`_qwen_vl_image_kwargs`): the first, overridden by the second's `image_processor`;
    the pixel bounds from `size`'s shortest_edge and longest_edge, overridden by
    min_pixels and max_pixels."""
    settings = {**preprocessor, **(processor.get("image_processor") or {})}
    bounds = settings.get("size") or {}
    chosen = {
        "patch_size": settings.get("patch_size"),
        "merge_size": settings.get("merge_size"),
        "min_pixels": _first(settings.get("min_pixels"), bounds.get("shortest_edge")),
        "max_pixels": _first(settings.get("max_pixels"), bounds.get("longest_edge")),
    }
    return QwenResize(**{name: value for name, value in chosen.items() if value is not None})


def _first(*values: int | None) -> int | None:
    return next((value for value in values if value is not None), None)
