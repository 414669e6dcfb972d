"""graphs/qwen2_5_vl_vision.py and graphs/mrope.py against transformers' Qwen2.5-VL, on a tiny
random model saved and loaded back (float32), two images of different sizes in one padded
bucket."""
import json

import jax
import numpy as np
import pytest
import torch

from maxjax.graphs import layers as L
from maxjax.graphs import mrope as R
from maxjax.graphs import qwen2_5_vl_vision as V

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

IMAGE, VIDEO, START, END = 250, 251, 252, 253
SECTION = [2, 3, 3]          # text head_dim 16: 8 frequencies
BUCKET = 160                 # the two images need 88 patches
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from safetensors import safe_open
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=1, eos_token_id=2,
                         rope_parameters=dict(rope_type="default", mrope_section=SECTION,
                                              rope_theta=10000.0)),
        # window_size 56: windows of 2 x 2 merged tokens, several per image, some cut short
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           patch_size=14, window_size=56, fullatt_block_indexes=[1],
                           out_hidden_size=64),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        # unit-scale weights, so that attention across the wrong patches shows in the output
        for name, p in model.model.visual.named_parameters():
            if p.ndim > 1:
                p.normal_(0.0, p[0].numel() ** -0.5)
            else:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    hf = json.loads((path / "config.json").read_text())
    vcfg = V.vision_config_from_hf(hf)
    with safe_open(str(path / "model.safetensors"), "np") as f:
        params = V.vision_params_from_hf(vcfg, f.get_tensor, np.float32)
    return model, vcfg, params


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    pics = [PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            for h, w in [(112, 84), (56, 140)]]
    proc = transformers.Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64,
                                              patch_size=14, merge_size=2, temporal_patch_size=2)
    out = proc(images=pics, return_tensors="np")
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def test_config(tiny):
    _, vcfg, _ = tiny
    assert vcfg.fullatt_block_indexes == (1,) and vcfg.window_merged == 2
    assert vcfg.mrope_section == tuple(SECTION) and vcfg.image_token_id == IMAGE
    hash(vcfg)
    assert V.VisionConfig(**vcfg.to_dict()) == vcfg


def test_encoder_matches_transformers(tiny, images):
    model, vcfg, params = tiny
    pixels, grid = images
    assert grid.tolist() == [[1, 8, 6], [1, 4, 10]]
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grid))
    want = out.pooler_output.numpy()
    n = sum(V.num_image_tokens(vcfg, g) for g in grid)
    assert want.shape == (n, vcfg.out_hidden_size)

    inputs = V.patch_inputs(vcfg, pixels, grid, BUCKET)
    specs = V.patch_input_specs(vcfg, BUCKET)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), inputs) == \
        jax.tree.map(lambda s: (s.shape, s.dtype), specs)
    got = np.asarray(jax.jit(V.encode_patches, static_argnums=0)(vcfg, params, inputs))
    assert got.shape == (BUCKET // 4, vcfg.out_hidden_size)
    err = np.abs(got[:n] - want).max() / np.abs(want).max()
    print(f"encoder max abs err / max abs: {err:.2e}")
    assert err < REL_TOL
    assert not got[n:].any()


def test_window_segments_differ_from_full(tiny, images):
    _, vcfg, _ = tiny
    inputs = V.patch_inputs(vcfg, *images, BUCKET)
    assert len(set(inputs.full_seg.tolist()) - {-1}) == 2
    # image 1: 4 x 3 merged tokens -> 2 x 2 windows; image 2: 2 x 5 -> 1 x 3
    assert len(set(inputs.window_seg.tolist()) - {-1}) == 7


def test_patch_inputs_rejects(tiny, images):
    _, vcfg, _ = tiny
    pixels, grid = images
    with pytest.raises(ValueError):
        V.patch_inputs(vcfg, pixels, grid, 84)          # too small
    with pytest.raises(ValueError):
        V.patch_inputs(vcfg, pixels, grid, 162)         # not a multiple of 4
    with pytest.raises(ValueError):
        V.patch_inputs(vcfg, pixels[:-4], grid, BUCKET)


def _prompt(vcfg, grid):
    ids = [5, 6, 7, START] + [IMAGE] * V.num_image_tokens(vcfg, grid[0]) + [END, 8, 9, START]
    ids += [IMAGE] * V.num_image_tokens(vcfg, grid[1]) + [END, 10, 11, 12]
    return np.asarray(ids)


def test_mrope_positions_match_get_rope_index(tiny, images):
    model, vcfg, _ = tiny
    _, grid = images
    ids = _prompt(vcfg, grid)
    got, delta = R.mrope_positions(ids, list(grid), IMAGE, vcfg.spatial_merge_size)
    t_ids = torch.from_numpy(ids)[None]
    want, want_delta = model.model.get_rope_index(
        t_ids, mm_token_type_ids=(t_ids == IMAGE).int(), image_grid_thw=torch.from_numpy(grid))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert delta == int(want_delta[0, 0]) and delta < 0
    with pytest.raises(ValueError):
        R.mrope_positions(ids, list(grid[:1]), IMAGE, 2)
    with pytest.raises(ValueError):
        R.mrope_positions(ids[:-20], list(grid), IMAGE, 2)


def test_mrope_rotation_matches_transformers(tiny, images):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb
    model, vcfg, _ = tiny
    _, grid = images
    ids = _prompt(vcfg, grid)
    pos, _ = R.mrope_positions(ids, list(grid), IMAGE, vcfg.spatial_merge_size)
    T, heads, hd = pos.shape[1], 4, 16
    q = np.random.default_rng(1).standard_normal((T, heads, hd)).astype(np.float32)

    rotary = model.model.language_model.rotary_emb
    tq = torch.from_numpy(q).transpose(0, 1)[None]          # [1, heads, T, hd]
    cos_t, sin_t = rotary(tq, torch.from_numpy(pos.astype(np.int64))[:, None, :])
    want, _ = apply_rotary_pos_emb(tq, tq, cos_t, sin_t)
    want = want[0].transpose(0, 1).numpy()

    inv = L.rope_inv_freq(hd, 10000.0, None)
    cos, sin = R.mrope_cos_sin(jax.numpy.asarray(pos), inv, vcfg.mrope_section)
    np.testing.assert_allclose(np.asarray(cos), cos_t[0].numpy(), atol=1e-5)
    got = np.asarray(L.apply_rope(jax.numpy.asarray(q), cos, sin))
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"mrope rotation max abs err / max abs: {err:.2e}")
    assert err < 1e-5
