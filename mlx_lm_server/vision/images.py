"""A request's images: read from a data URL or fetched from an http(s) URL,
checked, decoded, and named by a hash of their bytes. No MLX here.

Every way an image can be bad is an ``ImageError`` (the route's 400), never a
failure further down: bytes over ``MAX_IMAGE_BYTES`` (counted while they are
decoded from base64 or read from the network, not after), a URL that does
not answer within ``FETCH_TIMEOUT_S`` in all, bytes that are not an image,
a truncated file, and an image whose header declares more than
``MAX_IMAGE_PIXELS`` pixels, refused from the header before any pixel is
decoded (a decompression bomb: a few KB of PNG that would be gigabytes
decoded); Pillow's own bomb check (at its larger bound, as it opens the
header) is a 400 too.

Pillow is imported here only when an image comes (the ``vision`` extra
installs it): a text-only install never loads it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

# Bounds on one image: its encoded bytes, the pixels its header declares, the
# seconds a URL may take to deliver it.
MAX_IMAGE_BYTES = 20 << 20
MAX_IMAGE_PIXELS = 50_000_000
FETCH_TIMEOUT_S = 10.0

_DATA_URL = re.compile(r"data:(?P<mime>[\w.+/-]*)(?P<params>(;[^,;]*)*),", re.ASCII)


class ImageError(ValueError):
    """An image the server will not read: the message says which bound or
    what is wrong with it."""


@dataclass(frozen=True)
class LoadedImage:
    """A decoded image (a PIL image in RGB) and the hash of the bytes it came from."""

    image: Any
    digest: bytes  # sha256 of the encoded bytes


def image_bytes(url: str, *, max_bytes: int = MAX_IMAGE_BYTES,
                timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """The encoded bytes a part's ``url`` names: a ``data:`` URL (base64) or
    an http(s) URL fetched within ``timeout`` seconds and ``max_bytes``."""
    if url.startswith("data:"):
        return _data_url_bytes(url, max_bytes)
    if url.startswith(("http://", "https://")):
        return _fetched(url, max_bytes, timeout)
    raise ImageError("an image URL is a data: URL (base64) or an http(s) URL; got "
                     f"{url[:40]!r}")


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    m = _DATA_URL.match(url)
    if m is None or ";base64" not in m.group("params"):
        raise ImageError("a data URL image must be base64: data:image/png;base64,...")
    data = url[m.end():]
    # base64 holds 3 bytes per 4 characters: refused before decoding a body too large.
    if len(data) // 4 * 3 > max_bytes + 3:
        raise ImageError(f"the image is over {max_bytes} bytes")
    return decode_base64(data, max_bytes)


def decode_base64(data: str, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """``data`` (base64, as an Anthropic image block carries it) decoded,
    within ``max_bytes``."""
    if len(data) // 4 * 3 > max_bytes + 3:
        raise ImageError(f"the image is over {max_bytes} bytes")
    try:
        out = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data is not valid base64") from None
    if len(out) > max_bytes:
        raise ImageError(f"the image is over {max_bytes} bytes")
    return out


def _fetched(url: str, max_bytes: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "mlx-lm-server"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise ImageError(f"the image at {url} is {declared} bytes, over {max_bytes} bytes")
            chunks, size = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise ImageError(f"the image at {url} took over {timeout:g} s to fetch")
                chunk = response.read(min(1 << 16, max_bytes + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > max_bytes:
                    raise ImageError(f"the image at {url} is over {max_bytes} bytes")
            return b"".join(chunks)
    except ImageError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, timed out, bad status
        reason = getattr(e, "reason", None) or e
        raise ImageError(f"the image at {url} could not be fetched: {reason}") from None


def decoded(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> LoadedImage:
    """``data`` decoded to an RGB image (EXIF orientation applied, as
    mlx-vlm's own loader does), its size checked from the header first."""
    from PIL import Image, ImageOps

    digest = hashlib.sha256(data).digest()
    try:
        with Image.open(io.BytesIO(data)) as lazy:  # reads the header only
            width, height = lazy.size
            if width * height > max_pixels:
                raise ImageError(f"the image is {width} x {height} pixels, over the "
                                 f"{max_pixels} pixels this server decodes")
            lazy.load()
            image = ImageOps.exif_transpose(lazy).convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image is too large to decode: {e}") from None
    except Exception as e:  # not an image, truncated, a format Pillow cannot read
        raise ImageError(f"the image could not be decoded: {type(e).__name__}: {e}") from None
    return LoadedImage(image, digest)


def load_image(url: str, **bounds) -> LoadedImage:
    """A part's image from its URL: fetched or decoded from base64, then decoded."""
    max_pixels = bounds.pop("max_pixels", MAX_IMAGE_PIXELS)
    return decoded(image_bytes(url, **bounds), max_pixels=max_pixels)
