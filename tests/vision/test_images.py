"""An image's digest is of its pixels and the processor's settings, and what cannot be
decoded whole, or is too large, is refused before anything is decoded."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from server.http.errors import APIError
from server.images import ImageLimits, image_digest, load_images
from tests.vision.support import data_url, png

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20, max_images=4,
                     url_hosts=frozenset())


def encoded(data: bytes, format: str, **options) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).save(out, format=format, **options)
    return out.getvalue()


def test_the_same_pixels_in_another_file_have_the_same_digest():
    data = png(1)
    again = encoded(data, "PNG", compress_level=0)
    assert again != data
    assert image_digest(again, LIMITS.max_pixels, "s") == image_digest(data, LIMITS.max_pixels,
                                                                       "s")


def test_other_pixels_or_other_processor_settings_give_another_digest():
    digest = image_digest(png(1), LIMITS.max_pixels, "s")
    assert image_digest(png(2), LIMITS.max_pixels, "s") != digest
    assert image_digest(png(1), LIMITS.max_pixels, "other settings") != digest


@pytest.mark.parametrize(("data", "message"), [
    (b"GIF89a but not really", "not an image"),
    (png(3)[:200], "does not decode"),
    (png(3)[:len(png(3)) * 3 // 4], "does not decode"),
])
def test_what_does_not_decode_whole_is_refused(data, message):
    with pytest.raises(ValueError, match=message):
        image_digest(data, LIMITS.max_pixels, "s")


def test_a_decompression_bomb_is_refused_from_its_header():
    out = io.BytesIO()
    Image.new("1", (4096, 4096)).save(out, format="PNG")  # 16M pixels in a few kB
    with pytest.raises(ValueError, match="exceed this server's limit"):
        image_digest(out.getvalue(), LIMITS.max_pixels, "s")


def test_wrapped_base64_is_read_and_the_limits_hold():
    payload = base64.b64encode(png(4)).decode()
    wrapped = "data:image/png;base64," + "\n".join(
        payload[i:i + 76] for i in range(0, len(payload), 76))
    [(_, data)] = asyncio.run(load_images([wrapped], LIMITS, "s"))
    assert data == png(4)
    with pytest.raises(APIError, match="5 images exceed"):
        asyncio.run(load_images([data_url(png(5))] * 5, LIMITS, "s"))
    small = ImageLimits(max_bytes=100, max_pixels=1 << 20, max_images=4, url_hosts=frozenset())
    with pytest.raises(APIError, match="larger than this server's limit of 100 bytes"):
        asyncio.run(load_images([data_url(png(5))], small, "s"))
