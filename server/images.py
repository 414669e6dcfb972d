"""Images in chat messages: `image_url` content parts read from `data:` URLs (or, with
--allowed-local-media-path, local files), never fetched over the network, checked against the
server's limits and preprocessed for the model's image encoder (maxjax/models/vision.py) off the
event loop. Every failure is a 400 naming the content part."""
from __future__ import annotations

import base64
import binascii
import os
import urllib.parse
from dataclasses import dataclass

from .protocol import APIError


@dataclass(frozen=True)
class ImagePart:
    """Where an image was in the request (its `param` for errors) and its URL."""
    param: str
    url: str


def part_url(part: dict, param: str) -> str:
    """The URL of an `image_url` part: {"image_url": {"url": ...}} or {"image_url": "..."}."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{param}.image_url: needs a 'url' string", param=f"{param}.image_url")
    return url


def image_bytes(part: ImagePart, local_root: str | None, max_bytes: int) -> bytes:
    """The bytes of an image: a base64 `data:` URL, or a file under `local_root`."""
    url, param = part.url, part.param
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        head, sep, payload = url[5:].partition(",")
        if not sep or not head.endswith(";base64"):
            raise APIError(400, f"{param}: a data: URL needs ';base64,' and the image's bytes",
                           param=param)
        if len(payload) > max_bytes * 4 // 3 + 4:
            raise APIError(400, f"{param}: the image is over {max_bytes} bytes", param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"{param}: the data: URL is not valid base64",
                           param=param) from None
    if scheme in ("http", "https"):
        raise APIError(400, f"{param}: this server does not fetch remote images; send the image "
                            "as a data: URL (base64)", param=param)
    if scheme in ("file", ""):
        path = urllib.parse.unquote(urllib.parse.urlparse(url).path) if scheme else url
        return _local_file(path, part, local_root, max_bytes)
    raise APIError(400, f"{param}: unsupported image URL scheme {scheme!r} (data: URLs"
                        f"{', file: URLs' if local_root else ''})", param=param)


def _local_file(path: str, part: ImagePart, root: str | None, max_bytes: int) -> bytes:
    if root is None:
        raise APIError(400, f"{part.param}: local image files are read only under "
                            "--allowed-local-media-path, which this server does not set",
                       param=part.param)
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base or not os.path.isfile(real):
        raise APIError(400, f"{part.param}: no such image file under the allowed media path",
                       param=part.param)
    if os.path.getsize(real) > max_bytes:
        raise APIError(400, f"{part.param}: the image is over {max_bytes} bytes", param=part.param)
    with open(real, "rb") as f:
        return f.read()


def read_images(vision, parts: list[ImagePart], cfg) -> list:
    """The ImageInputs of `parts` (runs in a worker thread: decoding and preprocessing are CPU
    work); 400s name the part."""
    from maxjax.models.vision import read_image
    if len(parts) > cfg.max_images_per_request:
        raise APIError(400, f"messages: {len(parts)} images, over this server's "
                            f"{cfg.max_images_per_request} a request "
                            "(--max-images-per-request)", param="messages")
    out = []
    for part in parts:
        data = image_bytes(part, cfg.allowed_local_media_path, cfg.max_image_bytes)
        try:
            out.append(read_image(vision, data, cfg.max_image_pixels))
        except ValueError as e:
            raise APIError(400, f"{part.param}: {e}", param=part.param) from None
    return out
