"""An image's digest is of its pixels and the processor's settings, its size is the one
its decoded pixels have, and what cannot be decoded whole, or is too large, is refused
before anything is decoded."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import io
import threading
import time
from dataclasses import replace

import pytest
from PIL import Image

from engine.image_files import open_image, rgb_pixels
from engine.image_tokens import KEY_BASE, key_id
from server import images
from server.http.errors import APIError
from server.images import ImageLimits, checked_image, load_images
from tests.vision.support import data_url, png, webp_hiding_a_photocd

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20, max_images=4,
                     url_hosts=frozenset())


def encoded(data: bytes, format: str, **options) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(data)).save(out, format=format, **options)
    return out.getvalue()


def digest(data: bytes, settings: str = "s") -> str:
    return checked_image(data, LIMITS.max_pixels, settings).digest


def test_the_same_pixels_in_another_file_have_the_same_digest():
    data = png(1)
    again = encoded(data, "PNG", compress_level=0)
    assert again != data
    assert digest(again) == digest(data)


def test_other_pixels_or_other_processor_settings_give_another_digest():
    assert digest(png(2)) != digest(png(1))
    assert digest(png(1), "other settings") != digest(png(1))


def test_the_digest_is_of_the_settings_the_size_and_the_rgb_pixels():
    """What the radix keys of images already cached (on disk too) were made of."""
    data = png(1)
    pixels = Image.open(io.BytesIO(data)).convert("RGB")
    expected = hashlib.sha256(b"s" + f"{pixels.width}x{pixels.height}".encode()
                              + pixels.tobytes()).hexdigest()
    assert checked_image(data, LIMITS.max_pixels, "s").digest == expected


def test_the_size_is_the_decoded_pixels_turned_as_their_exif_orientation_says():
    """A phone's portrait photo is stored landscape with an orientation tag; the processor
    reads it upright, and so is its size (which sizes its tokens) read."""
    out, exif = io.BytesIO(), Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.new("RGB", (40, 20), "red").save(out, format="JPEG", exif=exif.tobytes())
    image = checked_image(out.getvalue(), LIMITS.max_pixels, "s")
    assert image.size == (20, 40)
    assert image.data == out.getvalue()
    assert checked_image(png(1, size=(30, 50)), LIMITS.max_pixels, "s").size == (50, 30)


def test_a_malformed_tag_beside_the_orientation_still_turns_the_picture():
    """Pillow's exif_transpose rewrites the EXIF it turns, and raised struct.error where a
    tag was malformed (a TileLength typed ASCII): a 500. The picture turns all the same."""
    exif = bytes.fromhex("4d4d002a000000080002014300020000000500000026011200030000000100"
                         "06000000000000646573630000")  # Orientation 6, and that tag
    pixels = Image.open(io.BytesIO(png(4, size=(16, 24))))
    out = io.BytesIO()
    pixels.save(out, format="PNG", exif=exif)
    image = checked_image(out.getvalue(), LIMITS.max_pixels, "s")
    assert image.size == (16, 24)
    upright = pixels.convert("RGB").transpose(Image.Transpose.ROTATE_270)
    assert rgb_pixels(open_image(out.getvalue())).tobytes() == upright.tobytes()


def test_a_file_is_read_as_one_of_the_formats_it_was_checked_as():
    """The digest and the model's input come from one decoding (engine/image_files.py): a
    WebP that also holds a PhotoCD picture is its WebP to both."""
    picture = Image.new("RGB", (32, 32), (30, 120, 200))
    picture.paste((250, 20, 20), (4, 4, 20, 12))
    data = webp_hiding_a_photocd(picture, 0x10)
    assert Image.open(io.BytesIO(data)).format == "PCD"  # what reading every format finds
    assert checked_image(data, LIMITS.max_pixels, "s").size == (32, 32)
    assert rgb_pixels(open_image(data)).tobytes() == picture.tobytes()


@pytest.mark.parametrize(("data", "message"), [
    (b"GIF89a but not really", "not an image"),
    (png(3)[:200], "does not decode"),
    (png(3)[:len(png(3)) * 3 // 4], "does not decode"),
])
def test_what_does_not_decode_whole_is_refused(data, message):
    with pytest.raises(ValueError, match=message):
        checked_image(data, LIMITS.max_pixels, "s")


def test_only_raster_formats_are_read():
    """Pillow reads EPS through Ghostscript where that is installed: a client's file is
    read as one of the APIs' formats or a plain raster one (a phone's MPO is JPEG's)."""
    def saved(format: str, **options) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (8, 8)).save(out, format=format, **options)
        return out.getvalue()

    for format in ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"):
        assert checked_image(saved(format), LIMITS.max_pixels, "s").size == (8, 8)
    mpo = saved("MPO", save_all=True, append_images=[Image.new("RGB", (8, 8))])
    assert checked_image(mpo, LIMITS.max_pixels, "s").size == (8, 8)
    for format in ("EPS", "PPM", "TGA"):
        with pytest.raises(ValueError, match=r"not an image this server reads \(PNG, JPEG"):
            checked_image(saved(format), LIMITS.max_pixels, "s")


def test_a_decompression_bomb_is_refused_from_its_header():
    out = io.BytesIO()
    Image.new("1", (4096, 4096)).save(out, format="PNG")  # 16M pixels in a few kB
    with pytest.raises(ValueError, match="exceed this server's limit"):
        checked_image(out.getvalue(), LIMITS.max_pixels, "s")


def test_wrapped_base64_is_read_and_the_limits_hold():
    payload = base64.b64encode(png(4)).decode()
    wrapped = "data:image/png;base64," + "\n".join(
        payload[i:i + 76] for i in range(0, len(payload), 76))
    [image] = asyncio.run(load_images([wrapped], LIMITS, "s"))
    assert image.data == png(4)
    padded = next(data for rows in range(40, 46) if len(data := png(4, (rows, 48))) % 3)
    unpadded = "data:image/png;base64," + base64.b64encode(padded).decode().rstrip("=")
    [image] = asyncio.run(load_images([unpadded], LIMITS, "s"))
    assert image.data == padded
    with pytest.raises(APIError, match="base64 payload is invalid"):
        asyncio.run(load_images(["data:image/png;base64," + payload + "A"], LIMITS, "s"))
    with pytest.raises(APIError, match="5 images exceed"):
        asyncio.run(load_images([data_url(png(5))] * 5, LIMITS, "s"))
    small = ImageLimits(max_bytes=100, max_pixels=1 << 20, max_images=4, url_hosts=frozenset())
    with pytest.raises(APIError, match="larger than this server's limit of 100 bytes"):
        asyncio.run(load_images([data_url(png(5))], small, "s"))


def test_the_byte_limit_counts_the_image_not_the_line_breaks_of_its_base64():
    """A MIME-wrapped payload (76 columns, CRLF) of an image at the limit is read: its
    line breaks are no bytes of the image (they were counted, and refused it)."""
    data = png(4)
    wrapped = "data:image/png;base64," + base64.encodebytes(data).decode().replace("\n", "\r\n")
    [image] = asyncio.run(load_images([wrapped], replace(LIMITS, max_bytes=len(data)), "s"))
    assert image.data == data
    with pytest.raises(APIError, match=f"larger than this server's limit of {len(data) - 1}"):
        asyncio.run(load_images([wrapped], replace(LIMITS, max_bytes=len(data) - 1), "s"))


def test_the_pixel_limit_holds_for_a_requests_images_together():
    """16 images each just under the limit, a request of under 1 MB, held 5 GB while they
    were decoded and stalled every other request for 10 s: the limit is the request's."""
    limits = ImageLimits(max_bytes=1 << 20, max_pixels=64 * 64 * 3, max_images=16,
                         url_hosts=frozenset())
    images = [data_url(png(seed, (64, 64))) for seed in range(4)]
    assert len(asyncio.run(load_images(images[:3], limits, "s"))) == 3
    with pytest.raises(APIError, match=r"image 4 \(with the 3 before it\): 64x64 pixels"):
        asyncio.run(load_images(images, limits, "s"))


def test_an_images_radix_key_is_60_bits_of_its_digest():
    """Every token of an image is keyed on its digest in the tree: two images whose keys
    are equal share KV. Keys once kept 30 bits (the digest's first 64 mod 2^30), and two
    noise images made to collide in under a second shared it: the second answered as the
    first. These two digests are such a pair."""
    first = "0" * 64
    second = f"{1 << 30:016x}" + "0" * 48
    assert int(first[:16], 16) % (1 << 30) == int(second[:16], 16) % (1 << 30)
    assert key_id(first) != key_id(second)
    digests = [hashlib.sha256(bytes([n])).hexdigest() for n in range(256)]
    keys = {key_id(digest) for digest in digests}
    assert len(keys) == 256
    assert all(KEY_BASE <= key < KEY_BASE + (1 << 60) < 1 << 63 for key in keys)


def test_a_host_that_sends_slowly_is_cut_off_at_the_fetch_timeout(monkeypatch):
    """httpx's timeout is per read: an allowed host sending a byte at a time held the
    request for as long as it kept sending."""
    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            for byte in png(6)[:40]:  # 2 s of it
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except ConnectionError:
                    return  # the fetch gave up, as it should
                time.sleep(0.05)

        def log_message(self, *args):
            pass

    monkeypatch.setattr(images, "FETCH_TIMEOUT_SECONDS", 0.5)
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    limits = replace(LIMITS, url_hosts=frozenset({"127.0.0.1"}))
    try:
        with pytest.raises(APIError, match="fetching it took over 0.5 s"):
            asyncio.run(load_images([f"http://127.0.0.1:{host.server_port}/a.png"],
                                    limits, "s"))
    finally:
        host.shutdown()
