"""Qwen2_5_VLForConditionalGeneration: Qwen2's text decoder (graphs/qwen2.py) with M-RoPE
(graphs/mrope.py), reading images through graphs/qwen2_5_vl_vision.py.

An image is preprocessed by the checkpoint's Qwen2VLImageProcessor (its patches and grid), encoded
alone on a bucket of patches, and takes grid_h * grid_w / merge**2 <|image_pad|> tokens, as
transformers' Qwen2_5_VLProcessor expands the prompt. Its tokens attend causally; their rope
positions are their image's (t, h, w) grid (transformers' Qwen2_5_VLModel.get_rope_index), and
every token after the prompt turns at its index + the prompt's rope delta.
"""
import dataclasses
import math

import numpy as np

from maxjax.graphs import qwen2, qwen2_5_vl_vision as qv
from maxjax.graphs.arch import Architecture
from maxjax.graphs.mrope import mrope_positions
from maxjax.graphs.vision import ImageFeatures, VisionSpec

MAX_GRAPHS = 6      # image buckets: the largest ones (a small image pads up to the smallest)


def config_from_hf(hf: dict):
    """The text model of a Qwen2.5-VL config.json: transformers 5's (text_config, flattened by
    maxjax/models/hf.py read_config) or the hub's flat one (rope_scaling {"type": "mrope"})."""
    mm = hf.get("multimodal_config") or hf
    text = dict(hf)
    text.setdefault("tie_word_embeddings", mm.get("tie_word_embeddings", False))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if section is None:
        raise ValueError("config.json has no mrope_section")
    if rope.get("rope_type", rope.get("type")) in ("mrope", "default"):
        text.pop("rope_scaling", None)
        text["rope_parameters"] = {"rope_theta": rope.get("rope_theta",
                                                          text.get("rope_theta", 1e6))}
    return dataclasses.replace(qwen2.config_from_hf(text), image_token_id=int(mm["image_token_id"]),
                               bidirectional_images=False,
                               mrope_section=tuple(int(s) for s in section))


@dataclasses.dataclass(frozen=True)
class VisionConfig(qv.VisionConfig):
    """The encoder's config and its image processor's pixel range (size shortest/longest_edge)."""
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280


def vision_config_from_hf(hf: dict) -> VisionConfig:
    return VisionConfig(**qv.vision_config_from_hf(hf).to_dict())


def with_processor(vcfg: VisionConfig, processor) -> VisionConfig:
    size = processor.size
    got = (processor.patch_size, processor.merge_size, processor.temporal_patch_size)
    want = (vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size)
    if got != want:
        raise ValueError(f"the image processor's patch, merge and temporal sizes {got} are not "
                         f"the encoder's {want}")
    return dataclasses.replace(vcfg, min_pixels=int(size["shortest_edge"]),
                               max_pixels=int(size["longest_edge"]))


def preprocess(vcfg, processor, image) -> ImageFeatures:
    out = processor(images=[image], return_tensors="np")
    pixels = np.asarray(out["pixel_values"], np.float32)
    grid = np.asarray(out["image_grid_thw"], np.int64).reshape(3)
    return ImageFeatures((pixels, grid), pixels.shape[0], qv.num_image_tokens(vcfg, grid),
                         {"grid": tuple(int(g) for g in grid)})


def max_patches(vcfg) -> int:
    """The patches of the largest image the processor makes (its resize keeps the pixels under
    max_pixels, in whole merge blocks)."""
    return vcfg.max_pixels // vcfg.patch_size ** 2 // vcfg.merge_unit * vcfg.merge_unit


def buckets(vcfg, largest: int) -> tuple[int, ...]:
    """Powers of two times merge**2 from the smallest image's patches, then `largest`; the
    MAX_GRAPHS largest of them."""
    unit = vcfg.merge_unit
    smallest = max(1, vcfg.min_pixels // vcfg.patch_size ** 2 // unit)
    size, sizes = unit * 2 ** math.ceil(math.log2(smallest)), []
    while size < largest:
        sizes.append(size)
        size *= 2
    return tuple(sizes[-(MAX_GRAPHS - 1):] + [largest])


def pad(vcfg, image: ImageFeatures, size: int):
    return qv.patch_inputs(vcfg, *image.inputs, size)


def expand_prompt(vcfg, tokenizer, text: str, images: list) -> str:
    """Each image's <|image_pad|> (as the chat template writes it) repeated once per token."""
    pad_token = tokenizer.convert_ids_to_tokens(vcfg.image_token_id)
    pieces = text.split(pad_token)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"the prompt has {len(pieces) - 1} {pad_token} tokens for "
                         f"{len(images)} images")
    out = [pieces[0]]
    for image, piece in zip(images, pieces[1:]):
        out += [pad_token * image.num_tokens, piece]
    return "".join(out)


def rope_positions(vcfg, token_ids, images: list) -> tuple[np.ndarray, int]:
    return mrope_positions(np.asarray(token_ids), [im.info["grid"] for im in images],
                           vcfg.image_token_id, vcfg.spatial_merge_size)


VISION = VisionSpec(vision_config_from_hf, qv.vision_param_shapes, qv.vision_params_from_hf,
                    preprocess, buckets, qv.patch_input_specs, pad, qv.encode_patches,
                    expand_prompt, max_patches, description="Qwen2.5-VL ViT, images only",
                    with_processor=with_processor, rope_positions=rope_positions)

ARCHITECTURE = Architecture("Qwen2_5_VLForConditionalGeneration", config_from_hf, vision=VISION,
                            description="Qwen2.5-VL reading images (M-RoPE)")
