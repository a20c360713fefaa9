"""Data a request sends inline: `data:` URLs and base64 payloads (images, documents)."""

from __future__ import annotations

import base64
import binascii


def split_data_url(url: str) -> tuple[str, str]:
    """A base64 `data:` URL's (media type, payload); ValueError for any other URL."""
    header, comma, payload = url.partition(",")
    scheme, _, media_type = header.partition(":")
    if not comma or scheme.strip().lower() != "data" \
            or not media_type.lower().endswith(";base64"):
        raise ValueError("a data: URL with a base64 payload is expected "
                         "(data:<media type>;base64,...)")
    return media_type[:-len(";base64")], payload


def decode_base64(payload: str) -> bytes:
    """The bytes of a base64 payload; line breaks inside it (MIME-style wrapping) and
    missing padding (RFC 4648 lets a use of it leave the padding out, as JWTs and some
    encoders do) are no error, anything else outside the alphabet is a ValueError."""
    text = "".join(payload.split())
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error as error:
        raise ValueError(f"the base64 payload is invalid: {error}") from error
