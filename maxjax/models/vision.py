"""An image-text model's image side on the host: its encoder's config and weights, its
transformers image processor, and images from a request's bytes to encoder inputs.

`vision_weights` and `image_processor` run with the text weights' load (maxjax/models/loader.py); `read_image` turns one
image's bytes into `ImageInput` (decoded with Pillow, preprocessed by the checkpoint's own
processor, keyed by a hash of its bytes so the prefix cache never mixes two images' K/V).
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any


from maxjax.errors import UserError
from maxjax.graphs.vision import ImageFeatures, VisionSpec


@dataclass
class VisionModel:
    spec: VisionSpec
    config: Any               # the spec's vision config
    params: dict
    processor: Any            # transformers' image processor of the checkpoint


@dataclass(frozen=True)
class ImageInput:
    """One image of a request, preprocessed: its features and the key of its content."""
    features: ImageFeatures
    key: int                  # < 0: what the prefix cache hashes in place of its tokens

    @property
    def num_tokens(self) -> int:
        return self.features.num_tokens


def vision_weights(spec: VisionSpec, hf: dict, get, dtype, path: str) -> tuple:
    """(vision config, params) of a checkpoint whose config.json is `hf` (the wrapper's, with
    vision_config), `get(name)` reading its tensors."""
    try:
        vcfg = spec.config_from_hf(hf)
    except (KeyError, ValueError) as e:
        raise UserError(f"{path}: unsupported vision config: {e}") from e
    return vcfg, spec.params_from_hf(vcfg, get, dtype)


def image_processor(directory: str):
    """The checkpoint's transformers image processor (Pillow backend). Call it on the thread
    that imports transformers' tokenizer: its lazy imports are not thread-safe."""
    from transformers import AutoImageProcessor
    try:
        return AutoImageProcessor.from_pretrained(directory, backend="pil")
    except Exception as e:
        raise UserError(f"{directory}: cannot load the image processor "
                        f"(preprocessor_config.json): {' '.join(str(e).split())}") from e


def vision_model(spec: VisionSpec, vcfg, params: dict, processor) -> VisionModel:
    if spec.with_processor is not None:
        vcfg = spec.with_processor(vcfg, processor)
    return VisionModel(spec, vcfg, params, processor)


def image_key(data: bytes) -> int:
    """A negative 62-bit number from the image's bytes: never a token id."""
    return -1 - int.from_bytes(hashlib.sha256(data).digest()[:8], "big") % (1 << 62)


def read_image(vision: VisionModel, data: bytes, max_pixels: int | None = None) -> ImageInput:
    """Decode and preprocess one image; ValueError (the reason, for a 400) when it is not an
    image Pillow reads, or larger than `max_pixels`."""
    from PIL import Image
    try:
        image = Image.open(io.BytesIO(data))
        if max_pixels and image.width * image.height > max_pixels:
            raise ValueError(f"the image is {image.width}x{image.height}, over the "
                             f"{max_pixels}-pixel limit (--max-image-pixels)")
        image = image.convert("RGB")
    except ValueError:
        raise
    except Exception as e:
        why = "its format is not one Pillow reads" if type(e).__name__ == \
            "UnidentifiedImageError" else " ".join(str(e).split())
        raise ValueError(f"not an image this server can read: {why}") from None
    features = vision.spec.preprocess(vision.config, vision.processor, image)
    return ImageInput(features, image_key(data))

