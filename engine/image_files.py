"""An image file's pixels, decoded one way for both of their uses: the server digests
them into the image's radix key (server/images.py) and the engine feeds them to the
model (engine/vision.py). Two decoders that read a file differently key one picture and
feed another: a WebP holding a PhotoCD image in a chunk WebP skips was keyed as its 32x32
WebP by a reader of a few formats, and fed to the model as the 768x512 PhotoCD by
mlx-vlm's, which tries every format Pillow knows; a second such file with the same WebP
then reused the first one's KV."""

from __future__ import annotations

import io

from PIL import Image

# The formats an image is read as: the APIs' (PNG, JPEG, GIF, WebP) and plain raster
# files, not every format Pillow knows (EPS is run through Ghostscript where that is
# installed).
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")

ORIENTATION = 0x0112  # the EXIF tag (Pillow also reads XMP's tiff:Orientation into it)
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
           4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
           6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}


def open_image(data: bytes) -> Image.Image:
    """The file `data` opened as one of `IMAGE_FORMATS`: its header read, nothing decoded
    (Pillow's UnidentifiedImageError where it is none of them)."""
    return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)


def rgb_pixels(image: Image.Image) -> Image.Image:
    """`image` decoded whole, turned upright as its orientation tag says, in RGB: what
    `ImageOps.exif_transpose` gives, without rewriting the EXIF, which raised struct.error,
    TypeError or AttributeError where a malformed tag sat beside the orientation."""
    image.load()
    try:
        orientation = image.getexif().get(ORIENTATION)
    except Exception:  # noqa: BLE001 - metadata Pillow cannot read says nothing of it
        orientation = None
    method = UPRIGHT.get(orientation) if isinstance(orientation, int) else None
    return (image.transpose(method) if method is not None else image).convert("RGB")
