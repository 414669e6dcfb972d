"""Gemma3ForConditionalGeneration: Gemma 3's text decoder (graphs/gemma3.py) reading images.

The image encoder is graphs/gemma3_vision.py (SigLIP and the multimodal projector), one
896x896 image (the checkpoint's `image_size`) per call, `mm_tokens_per_image` embeddings each.
As transformers' Gemma3Model does with `token_type_ids`, an image's tokens attend to each other
both ways (`bidirectional_images`); everything else is causal.
"""
import dataclasses

import jax
import numpy as np

from maxjax.graphs import gemma3, gemma3_vision as gv
from maxjax.graphs.arch import GEMMA_GGUF_NAMES, Architecture
from maxjax.graphs.vision import ImageFeatures, VisionSpec


def config_from_hf(hf: dict):
    mm = hf.get("multimodal_config") or {}
    image_token = mm.get("image_token_id", mm.get("image_token_index"))
    if image_token is None:
        raise ValueError("config.json has no image_token_id")
    return dataclasses.replace(gemma3.config_from_hf(hf), image_token_id=int(image_token),
                               bidirectional_images=True)


def preprocess(vcfg, processor, image) -> ImageFeatures:
    out = processor(images=[image], return_tensors="np", do_pan_and_scan=False)
    pixels = np.asarray(out["pixel_values"], np.float32)
    return ImageFeatures(pixels, 1, vcfg.mm_tokens_per_image, {})


def input_specs(vcfg, size: int):
    return jax.ShapeDtypeStruct((size, vcfg.num_channels, vcfg.image_size, vcfg.image_size),
                                np.float32)


def pad(vcfg, image: ImageFeatures, size: int):
    return image.inputs


def encode(vcfg, params, pixels):
    return gv.encode_images(vcfg, params, pixels).reshape(-1, vcfg.text_hidden_size)


def expand_prompt(vcfg, tokenizer, text: str, images: list) -> str:
    boi, image, eoi = tokenizer.convert_ids_to_tokens(
        [vcfg.boi_token_id, vcfg.image_token_id, vcfg.eoi_token_id])
    return gv.expand_image_prompt(text, len(images), vcfg, boi, image, eoi)


VISION = VisionSpec(gv.vision_config_from_hf, gv.vision_param_shapes, gv.vision_params_from_hf,
                    preprocess, lambda vcfg, largest: (1,), input_specs, pad, encode,
                    expand_prompt, lambda vcfg: 1, description="SigLIP, pan-and-scan off")

ARCHITECTURE = Architecture("Gemma3ForConditionalGeneration", config_from_hf,
                            gguf_layer_names=GEMMA_GGUF_NAMES, vision=VISION,
                            float16_overflows=True,
                            description="Gemma 3 reading images (SigLIP encoder)")
