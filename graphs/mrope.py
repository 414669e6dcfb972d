"""Qwen2.5-VL's multimodal rope (M-RoPE) for the text model: the 3-row (temporal, height, width)
positions of a prompt with images (transformers 5.24 Qwen2_5_VLModel.get_rope_index) and their
cos/sin (Qwen2_5_VLRotaryEmbedding), in graphs/layers.py's apply_rope layout."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _runs(is_image: np.ndarray) -> list[tuple[bool, int, int]]:
    """(is_image, start, end) of each run of equal values."""
    cuts = np.flatnonzero(np.diff(is_image.astype(np.int8))) + 1
    bounds = [0, *cuts.tolist(), len(is_image)]
    return [(bool(is_image[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _image_positions(grid_thw, start: int, merge: int) -> np.ndarray:
    t, h, w = (int(x) for x in np.asarray(grid_thw).reshape(3))
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge),
                             indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(input_ids: np.ndarray, grid_thws: list, image_token_id: int,
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """int32 [3, n] positions of one unpadded sequence (images only) and its rope delta (max
    position + 1 - n): a text token's three rows are its running position; each run of image
    tokens takes the next grid's (t, h/merge, w/merge) grid from the running position, which then
    moves on by max(h, w) / merge. Transformers 5.24 finds the images by their runs of image
    tokens (older versions looked for the vision-start token). A sequence continues at position
    index + delta on all three rows."""
    ids = np.asarray(input_ids).reshape(-1)
    if ids.size == 0:
        return np.zeros((3, 0), np.int32), 0
    grids = list(grid_thws)
    pieces, pos, used = [], 0, 0
    for image, a, b in _runs(ids == image_token_id):
        if not image:
            pieces.append(np.broadcast_to(np.arange(b - a) + pos, (3, b - a)))
            pos += b - a
            continue
        if used == len(grids):
            raise ValueError(f"more image-token runs than the {len(grids)} grids given")
        piece = _image_positions(grids[used], pos, spatial_merge_size)
        if piece.shape[1] != b - a:
            raise ValueError(f"image {used}: {b - a} image tokens, its grid {grids[used]} "
                             f"needs {piece.shape[1]}")
        pieces.append(piece)
        _, h, w = (int(x) for x in np.asarray(grids[used]).reshape(3))
        pos += max(h, w) // spatial_merge_size
        used += 1
    if used != len(grids):
        raise ValueError(f"{len(grids)} grids given for {used} image-token runs")
    positions = np.concatenate(pieces, axis=1).astype(np.int32)
    return positions, int(positions.max()) + 1 - ids.size


def mrope_cos_sin(positions3, inv_freq, mrope_section):
    """positions3 int32 [3, T] -> cos, sin [T, 2 * sum(mrope_section)]: frequency band i of
    `mrope_section` turns with row i % 3 (temporal, height, width), the half repeated as
    L.rope_cos_sin does, for L.apply_rope."""
    section = tuple(int(s) for s in mrope_section)
    if sum(section) != inv_freq.shape[-1]:
        raise ValueError(f"mrope_section {section} does not sum to {inv_freq.shape[-1]} "
                         f"(head_dim / 2)")
    freqs = positions3.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
    bounds = np.cumsum((0, *section))
    half = jnp.concatenate([freqs[i % 3, :, a:b]
                            for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))], axis=-1)
    emb = jnp.concatenate([half, half], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)
