"""What an architecture that reads images provides: its image encoder, as pure functions.

An image-text architecture (`Architecture.vision`) is its text decoder (graphs/decoder.py) plus a
`VisionSpec`: the encoder's config and weights, a compiled graph per image size bucket
(`encode` over `input_specs(vcfg, size)`), and how a prompt makes room for an image. The engine
(maxjax/engine/vision.py) preprocesses each image on the host with the checkpoint's own
transformers image processor, encodes it alone, and hands its embeddings to the step graphs, which
put them at the image's placeholder tokens (graphs/step.py `embeds`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import numpy as np

from maxjax.graphs.program import GraphSpec, abstract


@dataclass(frozen=True)
class ImageFeatures:
    """One preprocessed image: the encoder's inputs, unpadded (numpy), and what it becomes."""
    inputs: Any               # the family's numpy pytree (`pad` makes it a bucket's)
    size: int                 # what picks its bucket (the smallest of `buckets` >= size)
    num_tokens: int           # placeholder tokens (and embeddings) it takes in a prompt
    info: dict                # what the prompt expansion reads (e.g. Qwen's grid)


@dataclass(frozen=True)
class VisionSpec:
    # The whole config.json of the image-text checkpoint -> a frozen, hashable vision config
    # with `to_dict()`; a ValueError refuses it.
    config_from_hf: Callable[[dict], Any]
    param_shapes: Callable[[Any], dict]                      # vcfg -> pytree of shapes
    params_from_hf: Callable[[Any, Callable, Any], dict]     # (vcfg, get, dtype) -> params
    # (vcfg, transformers image processor, PIL image) -> ImageFeatures
    preprocess: Callable[[Any, Any, Any], ImageFeatures]
    buckets: Callable[[Any, int], tuple[int, ...]]           # (vcfg, largest size) -> sizes
    input_specs: Callable[[Any, int], Any]                   # (vcfg, size) -> ShapeDtypeStructs
    pad: Callable[[Any, ImageFeatures, int], Any]            # (vcfg, image, size) -> numpy pytree
    # (vcfg, params, inputs) -> [tokens of the bucket, text hidden]: the image's embeddings
    # first (ImageFeatures.num_tokens of them), padding after
    encode: Callable[[Any, dict, Any], Any]
    # (vcfg, tokenizer, prompt text as the chat template wrote it, [ImageFeatures]) -> the
    # text with each image's placeholder run, as the checkpoint's transformers processor does
    expand_prompt: Callable[[Any, Any, str, list], str]
    max_size: Callable[[Any], int]                           # vcfg -> the largest image's size
    description: str = ""
    # (vcfg, transformers image processor) -> vcfg with what the processor decides (e.g. the
    # largest image it makes); None: the config.json says it all.
    with_processor: Callable[[Any, Any], Any] | None = None
    # M-RoPE (ModelConfig.mrope_section): (vcfg, prompt token ids, [ImageFeatures]) -> (int32
    # [3, n] rope positions of the prompt, delta): token i >= n turns at i + delta on all rows.
    rope_positions: Callable[[Any, Any, list], tuple] | None = None


def placeholder_runs(token_ids, image_token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `image_token_id` in a prompt, in order."""
    ids = np.asarray(token_ids)
    is_image = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def graph_name(size: int) -> str:
    return f"vision_{size}"


def _encode_graph(spec: VisionSpec, vcfg, params, inputs):
    return spec.encode(vcfg, params, inputs), ()      # (outputs, no KV): the graphs' convention


def vision_sizes(spec: VisionSpec, vcfg) -> tuple[int, ...]:
    """The image size buckets, smallest first: one graph each."""
    return tuple(sorted(spec.buckets(vcfg, spec.max_size(vcfg))))


def vision_graph_specs(vision) -> list[GraphSpec]:
    """One graph per image size bucket of a VisionModel (maxjax/models/vision.py):
    (params, inputs) -> (embeddings, ())."""
    spec, vcfg = vision.spec, vision.config
    fn = partial(_encode_graph, spec, vcfg)
    return [GraphSpec(graph_name(s), None, fn,
                      (abstract(vision.params), spec.input_specs(vcfg, s)), (), returns_kv=False,
                      arg_names=("params", "images"))
            for s in vision_sizes(spec, vcfg)]
