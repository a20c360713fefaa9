"""Images a request sends, fetched and checked before its prompt is built.

Every API's image part comes down to a URL (`GenerationRequest.images`): a `data:` URL
(Anthropic's base64 source becomes one), or an http(s) URL, fetched only from the hosts
`allow_image_urls` names. No other scheme is read: a file path or file:// URL is refused,
as is a redirect (it could lead anywhere). Each image must decode whole (a truncated PNG
is refused, not padded), within the byte and pixel limits (the pixel count is read from
the header, before decoding: a decompression bomb is refused unread). What comes out is
the digest the radix cache keys the image on (engine/image_tokens.py): of the decoded RGB
pixels, as the model's processor reads them, and of the processor's settings; and the
decoded size, from which the prompt counts a Qwen-VL image's tokens without decoding it
again.
"""

from __future__ import annotations

import asyncio
import hashlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from engine.api import ImageFile
from engine.image_files import IMAGE_FORMATS, open_image, rgb_pixels
from server.data_urls import decode_base64, split_data_url
from server.http.errors import APIError

# The most one image's fetch may take, from the request to its last byte.
FETCH_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    max_images: int
    url_hosts: frozenset[str]  # hosts whose http(s) URLs are fetched


async def load_images(sources: Sequence[str], limits: ImageLimits, settings: str
                      ) -> list[ImageFile]:
    """Each image of `sources`, in order, checked; `settings`: the digest of the model's
    processor settings. A 400 names the first image that fails."""
    if len(sources) > limits.max_images:
        raise APIError(400, f"{len(sources)} images exceed this server's limit of "
                       f"{limits.max_images} per request", code="invalid_image")
    loaded: list[ImageFile] = []
    pixels = 0  # of the images before: max_pixels holds for a request's images together
    for index, source in enumerate(sources):
        try:
            data = await _read(source, limits)
            image = await asyncio.to_thread(checked_image, data, limits.max_pixels - pixels,
                                            settings)
        except ValueError as error:
            together = f" (with the {index} before it)" if pixels else ""
            raise APIError(400, f"image {index + 1}{together}: {error}",
                           code="invalid_image") from error
        pixels += image.size[0] * image.size[1]
        loaded.append(image)
    return loaded


def checked_image(data: bytes, max_pixels: int, settings: str) -> ImageFile:
    """The image file `data` with the digest and size of its pixels, decoded; ValueError
    if it is no image, is larger than `max_pixels` or does not decode whole."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = open_image(data)
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(f"{width}x{height} pixels exceed this server's limit of "
                                 f"{max(max_pixels, 0)}")
            pixels = rgb_pixels(image)
    except UnidentifiedImageError as error:
        raise ValueError("the data is not an image this server reads "
                         f"({', '.join(IMAGE_FORMATS)})") from error
    except (OSError, SyntaxError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as error:
        raise ValueError(f"the image does not decode: {error}") from error
    digest = hashlib.sha256(settings.encode())
    digest.update(f"{pixels.width}x{pixels.height}".encode())
    digest.update(pixels.tobytes())
    return ImageFile(digest.hexdigest(), pixels.size, data)


async def _read(source: str, limits: ImageLimits) -> bytes:
    scheme = urlsplit(source).scheme.lower()
    if scheme == "data":
        return _data_url(source, limits.max_bytes)
    if scheme in ("http", "https"):
        return await _fetch(source, limits)
    raise ValueError("an image URL is a data: URL (data:image/png;base64,...) or, from the "
                     "hosts the server allows, an http(s) URL; files are never read")


def _data_url(url: str, max_bytes: int) -> bytes:
    _, payload = split_data_url(url)
    # Refused before decoding by the size its base64 characters make, 3 bytes per 4 (up to
    # 2 of them padding); the line breaks of a MIME-wrapped payload make none.
    characters = sum(len(line) for line in payload.split())
    if characters * 3 // 4 > max_bytes + 2:
        raise ValueError(f"the image is larger than this server's limit of {max_bytes} bytes")
    data = decode_base64(payload)
    if len(data) > max_bytes:
        raise ValueError(f"the image is larger than this server's limit of {max_bytes} bytes")
    return data


async def _fetch(url: str, limits: ImageLimits) -> bytes:
    # The host is checked as the client that fetches reads it (a tab in the authority, say,
    # is not read alike by every parser), and a port out of range is refused here: httpx
    # took it to the socket, which raised OverflowError.
    try:
        target = httpx.URL(url)
        urlsplit(url).port  # noqa: B018 - read for its ValueError
    except (httpx.InvalidURL, ValueError) as error:
        raise ValueError(f"the image URL does not parse: {error}") from error
    host = target.host
    if host.lower() not in limits.url_hosts:
        raise ValueError(f"image URLs from {host!r} are not fetched by this server "
                         "(allow_image_urls); send the image as a data: URL")
    try:
        async with (asyncio.timeout(FETCH_TIMEOUT_SECONDS),
                    httpx.AsyncClient(timeout=FETCH_TIMEOUT_SECONDS,
                                      follow_redirects=False) as client,
                    client.stream("GET", target) as response):
            if response.status_code != 200:
                raise ValueError(f"fetching it answered {response.status_code}")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > limits.max_bytes:
                    raise ValueError(f"the image is larger than this server's limit of "
                                     f"{limits.max_bytes} bytes")
            return bytes(data)
    except TimeoutError as error:
        raise ValueError(f"fetching it took over {FETCH_TIMEOUT_SECONDS:g} s") from error
    except httpx.HTTPError as error:
        raise ValueError(f"fetching it failed: {error}") from error
