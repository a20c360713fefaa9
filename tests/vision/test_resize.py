"""The token count and patch grid the server and the engine take from a Qwen-VL image's size
(engine/qwen_resize.py) are those mlx-vlm's processor gives the image's pixels, over sizes
and aspect ratios, for the processor settings Qwen's folders write; an image whose sides
differ by more than 200x is refused by both."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from engine.loader import load_tokenizer

# preprocessor_config.json (and processor_config.json) settings, beside the demo folder's
# own (4-pixel patches, at most 32x32 pixels: every image is resized down or up).
SETTINGS = {
    # Qwen2.5-VL-7B-Instruct's, as published.
    "qwen2.5-vl": ({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                    "temporal_patch_size": 2, "merge_size": 2}, None),
    # Newer transformers' form: the pixel bounds as `size`, one overridden by the
    # processor_config.json's image processor.
    "size-and-override": ({"size": {"shortest_edge": 3136, "longest_edge": 12845056},
                           "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2},
                          {"image_processor": {"max_pixels": 200704}}),
}

SIZES = [(1, 1), (1, 200), (200, 1), (27, 29), (28, 28), (56, 56), (640, 480), (480, 640),
         (1280, 720), (1080, 1920), (1500, 8), (13, 2600), (333, 1111)]
REFUSED = [(1, 201), (201, 1), (600, 2), (2, 600), (4100, 20)]


def random_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    """(width, height) pairs from 1 to 1500 pixels a side, log-uniform: every aspect ratio
    the processor takes."""
    rng = np.random.default_rng(seed)
    sizes = []
    while len(sizes) < count:
        width, height = np.exp(rng.uniform(0, np.log(1500), 2)).astype(int)
        if max(width, height) / min(width, height) <= 200:
            sizes.append((int(width), int(height)))
    return sizes


@pytest.fixture(scope="module", params=["demo", *SETTINGS])
def folder(request, demo_qwen_vl_dir, tmp_path_factory):
    """The demo Qwen2.5-VL's folder without its weights, with the processor settings named."""
    folder = tmp_path_factory.mktemp(request.param)
    for source in demo_qwen_vl_dir.iterdir():
        if source.suffix == ".json":
            shutil.copy(source, folder)
    if request.param in SETTINGS:
        preprocessor, processor = SETTINGS[request.param]
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
        if processor is not None:
            (folder / "processor_config.json").write_text(json.dumps(processor))
    return folder


@pytest.fixture(scope="module")
def images(folder):
    """How the server's tokenizer of `folder` counts images."""
    return load_tokenizer(folder).images


@pytest.fixture(scope="module")
def processor(folder):
    """mlx-vlm's image processor of `folder`, loaded as `Vision` loads it."""
    from mlx_vlm import utils

    utils.get_model_and_args(json.loads((folder / "config.json").read_text()))
    return utils.load_processor(folder, add_detokenizer=False).image_processor


def size_id(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


@pytest.mark.parametrize("size", SIZES + random_sizes(24, seed=0), ids=size_id)
def test_the_count_and_grid_from_the_size_are_the_processors(images, processor, size):
    processed = processor([Image.new("RGB", size)], return_tensors="np")
    _, rows, columns = processed["image_grid_thw"][0]
    assert images.resize.grid(size) == (rows, columns)
    assert images.count(size) == rows * columns // processor.merge_size ** 2
    assert len(processed["pixel_values"]) == rows * columns


@pytest.mark.parametrize("size", REFUSED, ids=size_id)
def test_an_aspect_ratio_over_200_is_refused_as_the_processor_refuses_it(images, processor,
                                                                          size):
    with pytest.raises(ValueError, match="aspect ratio"):
        processor([Image.new("RGB", size)], return_tensors="np")
    with pytest.raises(ValueError, match="aspect ratio"):
        images.count(size)


def test_gemma_gives_every_image_its_configs_count(demo_vlm_dir):
    images = load_tokenizer(demo_vlm_dir).images
    assert images.resize is None
    assert images.count((1, 1)) == images.count((1000, 3)) == images.tokens_per_image > 0
