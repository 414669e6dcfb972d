"""ImageEncoder: the compiled image encoder graphs of an image-text model, and the images of a
request turned into what its steps read.

One executable per image size bucket (graphs/vision.py), compiled at warm-up or loaded from
artifacts like the step graphs, so an image never compiles anything while serving. Each image
is encoded alone when its request is added (on the engine thread); its embeddings stay on the
request (`ImageSpan`), so a preempted request recomputes its K/V without encoding again. The
last `cache_images` images' embeddings are kept by content, so a conversation that resends an
image does not encode it again.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np

from maxjax.errors import RequestError
from maxjax.graphs.program import jit_kwargs
from maxjax.graphs.vision import graph_name, placeholder_runs, vision_graph_specs, vision_sizes

log = logging.getLogger("maxjax.vision")


@dataclass
class ImageSpan:
    """One image of a request's prompt: its placeholder tokens and their embeddings."""
    start: int                # position of its first placeholder token
    length: int
    key: int                  # its content's key (maxjax/models/vision.py `image_key`)
    embeds: np.ndarray        # [length, hidden]
    whole: bool = False       # its tokens attend to each other both ways: one chunk computes it


class ImageEncoder:
    def __init__(self, vision, executables: dict[str, Callable] | None = None,
                 cache_images: int = 64):
        """`vision`: the model's VisionModel (maxjax/models/vision.py); `executables`: graph
        name -> loaded executable (None: compiled by `compile_all`)."""
        self.vision = vision
        self.spec, self.config = vision.spec, vision.config
        self.sizes = vision_sizes(self.spec, self.config)
        self.executables: dict[str, Callable] = dict(executables or {})
        self.cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self.cache_images = cache_images
        self.encoded = 0          # images run through the encoder (cache hits are not)

    def graph_specs(self):
        return vision_graph_specs(self.vision)

    def compile_all(self) -> None:
        for spec in self.graph_specs():
            if spec.name not in self.executables:
                t0 = time.perf_counter()
                self.executables[spec.name] = jax.jit(
                    spec.fn, **jit_kwargs(spec)).lower(*spec.args).compile()
                log.debug("compiled %s in %.2fs", spec.name, time.perf_counter() - t0)

    def prime(self) -> None:
        """Run each encoder once on zeros (an executable's first run costs more on the CPU)."""
        for spec in self.graph_specs():
            zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), spec.args[1])
            jax.block_until_ready(self.executables[spec.name](self.vision.params, zeros))

    def bucket(self, size: int) -> int:
        for s in self.sizes:
            if s >= size:
                return s
        raise RequestError("messages", f"an image of size {size} is over the largest this model "
                                       f"encodes ({self.sizes[-1]})")

    def embed(self, image) -> np.ndarray:
        """[num_tokens, hidden] embeddings of one ImageInput."""
        hit = self.cache.get(image.key)
        if hit is not None:
            self.cache.move_to_end(image.key)
            return hit
        f = image.features
        size = self.bucket(f.size)
        out, _ = self.executables[graph_name(size)](self.vision.params,
                                                     self.spec.pad(self.config, f, size))
        embeds = np.asarray(jax.device_get(out))[:f.num_tokens]
        self.encoded += 1
        self.cache[image.key] = embeds
        while len(self.cache) > self.cache_images:
            self.cache.popitem(last=False)
        return embeds

    def spans(self, prompt_token_ids, images: list, cfg, max_chunk: int) -> list[ImageSpan]:
        """The prompt's image placeholder runs, each with its image's embeddings; RequestError
        (field "messages") when the runs do not match the images one to one, or an image
        attended both ways is longer than a step's `max_chunk` tokens."""
        runs = placeholder_runs(prompt_token_ids, cfg.image_token_id)
        if [n for _, n in runs] != [im.num_tokens for im in images]:
            raise RequestError("messages", f"the prompt holds {len(runs)} image placeholder "
                                           f"runs for {len(images)} images")
        if cfg.bidirectional_images and runs and max(n for _, n in runs) > max_chunk:
            raise RequestError("messages", f"an image takes {max(n for _, n in runs)} tokens, "
                                           f"over the {max_chunk} a step computes "
                                           "(--max-batch-input-tokens)")
        return [ImageSpan(start, n, im.key, self.embed(im), cfg.bidirectional_images)
                for (start, n), im in zip(runs, images)]

    def rope_positions(self, prompt_token_ids, images: list) -> tuple:
        """(int32 [3, n], delta) M-RoPE positions of a prompt with these images (a model with
        cfg.mrope_section), or (None, 0): its positions are its tokens' places."""
        if self.spec.rope_positions is None:
            return None, 0
        return self.spec.rope_positions(self.config, prompt_token_ids,
                                        [im.features for im in images])


def rope_rows(positions: np.ndarray, delta: int, start: int, n: int) -> np.ndarray:
    """int32 [3, n] M-RoPE positions of tokens [start, start + n) of a sequence whose prompt's
    are `positions` [3, len(prompt)]: a token past the prompt at index + delta on all rows."""
    prompt = positions.shape[1]
    out = np.tile(np.arange(start, start + n, dtype=np.int32) + delta, (3, 1))
    a, b = min(start, prompt), min(start + n, prompt)
    out[:, a - start:b - start] = positions[:, a:b]
    return out


def image_rows(spans: list[ImageSpan], start: int, n: int):
    """(embeds [n, hidden], embed_mask bool[n], visible_end int[n]) of a row's tokens
    [start, start + n) of a request with images (graphs/step.py): a token of an image attended
    both ways sees its whole image."""
    dim = spans[0].embeds.shape[1]
    embeds = np.zeros((n, dim), spans[0].embeds.dtype)
    mask = np.zeros(n, np.bool_)
    end = np.arange(start, start + n, dtype=np.int32)
    for s in spans:
        a, b = max(s.start, start), min(s.start + s.length, start + n)
        if a >= b:
            continue
        embeds[a - start:b - start] = s.embeds[a - s.start:b - s.start]
        mask[a - start:b - start] = True
        if s.whole:
            end[a - start:b - start] = s.start + s.length - 1
    return embeds, mask, end


def chunk_end(spans: list[ImageSpan], start: int, end: int) -> int:
    """Where a prefill chunk [start, end) must stop so that it splits no image attended both
    ways: before the image it would cut (`start` when it begins inside it: no chunk this step,
    the image's rest must fit a later one)."""
    for s in spans:
        if s.whole and s.start < end < s.start + s.length:
            return max(s.start, start)
    return end
