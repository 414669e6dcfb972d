"""Qwen2.5-VL reading images (graphs/qwen2_5_vl.py) against transformers'
Qwen2_5_VLForConditionalGeneration on a tiny random checkpoint: two PNG images of different sizes
(and so grids, buckets and rope deltas) with a text-only request in one batch, through the engine;
prompt logprobs of a prompt prefilled in chunks; the decode positions' rope delta matters."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from maxjax.engine.types import SamplingParams
from vlm_helpers import engine_core, load, png as _png, write_word_tokenizer

pytestmark = pytest.mark.slow

IMAGE, VIDEO, START, END = 250, 251, 252, 253
VOCAB, NEW_TOKENS = 256, 12
SPECIAL = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
           "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}
PROCESSOR = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2,
                 temporal_patch_size=2)
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=96, num_kv_pages=48,
              kv_cache_page_size=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=1, eos_token_id=2,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3],
                                              rope_theta=10000.0)),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                           patch_size=14, window_size=56, fullatt_block_indexes=[1],
                           out_hidden_size=64),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():    # the init zeroes or ones some: make every parameter matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB, SPECIAL, {"image_token": IMAGE, "video_token": VIDEO,
                                                "vision_start_token": START,
                                                "vision_end_token": END})
    transformers.Qwen2VLImageProcessor(**PROCESSOR).save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load(checkpoint[1])


@pytest.fixture(scope="module")
def core(loaded):
    return engine_core(loaded, ENGINE)


def _prompt(model, words: str, image) -> list[int]:
    pad = f"{SPECIAL['vision_start_token']}{SPECIAL['image_token']}{SPECIAL['vision_end_token']}"
    text = model.vision.spec.expand_prompt(model.vision.config, model.tokenizer,
                                           f"w5 w6 {pad} {words}", [image.features])
    return model.tokenizer.encode(text, add_special_tokens=False)


def _hf_inputs(ids, png: bytes | None) -> dict:
    from PIL import Image
    from transformers import Qwen2VLImageProcessor
    x = torch.tensor([ids])
    kw = {"input_ids": x, "attention_mask": torch.ones_like(x)}
    if png is not None:
        out = Qwen2VLImageProcessor(**PROCESSOR)([Image.open(io.BytesIO(png)).convert("RGB")],
                                                 return_tensors="pt")
        kw.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                  mm_token_type_ids=(x == IMAGE).int())
    return kw


def _hf_greedy(hf_model, ids, png: bytes | None) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(**_hf_inputs(ids, png), max_new_tokens=NEW_TOKENS,
                                do_sample=False)
    return out[0, len(ids):].tolist()


def _run(core, requests: dict) -> dict:
    """request id -> (prompt ids, [ImageInput] or None), run together -> id -> tokens."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for rid, (ids, images) in requests.items():
        core.add_request(rid, ids, greedy, images=images)
    tokens: dict = {rid: [] for rid in requests}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


PNGS = {"a": (1, (56, 56, 3)), "b": (2, (84, 112, 3))}


@pytest.fixture(scope="module")
def batch(loaded):
    """Two images (4 and 12 tokens, their own buckets) and a text-only request, as requests."""
    from maxjax.models.vision import read_image
    pngs = {k: _png(*v) for k, v in PNGS.items()}
    images = {k: read_image(loaded.vision, p) for k, p in pngs.items()}
    words = {"a": "w7 w8 w9 w10 w11 w12 w13 w14", "b": "w20 w21 w22"}
    requests = {k: (_prompt(loaded, words[k], images[k]), [images[k]]) for k in images}
    requests["text"] = ([5, 6, 7, 8, 9], None)
    return requests, {**pngs, "text": None}


def test_config(loaded):
    cfg, vcfg = loaded.config, loaded.vision.config
    assert cfg.mrope_section == (2, 3, 3) and cfg.image_token_id == IMAGE
    assert not cfg.bidirectional_images
    assert (vcfg.min_pixels, vcfg.max_pixels) == (3136, 12544)
    assert loaded.vision.spec.buckets(vcfg, loaded.vision.spec.max_size(vcfg)) == (16, 32, 64)


def test_two_images_and_text_in_one_batch_match_transformers(checkpoint, core, batch):
    requests, pngs = batch
    assert [im.num_tokens for k in "ab" for im in requests[k][1]] == [4, 12]
    got = _run(core, requests)
    for rid, (ids, _) in requests.items():
        assert len(got[rid]) == NEW_TOKENS
        assert got[rid] == _hf_greedy(checkpoint[0], ids, pngs[rid]), rid
    assert got["a"] != got["b"]
    assert core.images.encoded == 2 and core.step_compiles == 0


def test_decode_without_the_rope_delta_differs(monkeypatch, checkpoint, core, batch):
    """The check above needs the delta: with decode tokens at their plain index, an image's
    request (12 image tokens, delta -8) goes another way."""
    from maxjax.engine import core as core_module
    requests, pngs = batch
    real = core_module.rope_rows
    monkeypatch.setattr(core_module, "rope_rows",
                        lambda pos, delta, start, n: real(pos, 0, start, n))
    got = _run(core, {"b2": requests["b"]})
    assert got["b2"] != _hf_greedy(checkpoint[0], requests["b"][0], pngs["b"])


def test_prompt_logprobs_match_transformers(checkpoint, loaded, core):
    """Logprobs of every prompt token, the image split across prefill chunks (its tokens
    attend causally)."""
    from maxjax.models.vision import read_image
    png = _png(3, (84, 84, 3))
    image = read_image(loaded.vision, png)
    ids = _prompt(loaded, " ".join(f"w{i}" for i in range(30, 50)), image)
    assert len(ids) > ENGINE["max_batch_input_tokens"]          # prefilled in chunks
    params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=True)
    core.add_request("lp", ids, params, images=[image])
    got = None
    while core.has_unfinished():
        for out in core.step():
            got = out.prompt_logprobs or got
    kw = _hf_inputs(ids, png)
    with torch.no_grad():
        logits = checkpoint[0](**kw).logits[0]
    x = kw["input_ids"]
    want = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0].numpy()
    mine = np.array([lp.logprob for lp in got[1:]])
    err = np.abs(mine - want).max()
    print(f"prompt logprobs max abs err: {err:.2e}")
    np.testing.assert_allclose(mine, want, atol=1e-3)


def test_recomputed_after_preemption_matches_transformers(checkpoint, core, batch):
    """A request preempted mid-decode (its K/V and the prefix cache gone) recomputes its prompt
    and its tokens so far at the same rope positions."""
    requests, pngs = batch
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    core.add_request("pre", *requests["b"][:1], greedy, images=requests["b"][1])
    tokens: list = []
    preempted = False
    while core.has_unfinished():
        for out in core.step():
            tokens.extend(out.new_token_ids)
        if len(tokens) >= 5 and not preempted:
            core.scheduler.preempt_running()
            core.block_manager.reset_prefix_cache()
            preempted = True
    assert preempted and tokens == _hf_greedy(checkpoint[0], requests["b"][0], pngs["b"])


def test_int8_perplexity_within_bound(checkpoint, loaded, core):
    from maxjax.models.vision import read_image
    from vlm_helpers import INT8_PPL_RATIO, int8_core, perplexity
    image = read_image(loaded.vision, _png(4, (56, 84, 3)))
    ids = _prompt(loaded, " ".join(f"w{i}" for i in range(80, 100)), image)
    ppl = {"float32": perplexity(core, ids, [image]),
           "int8": perplexity(int8_core(str(checkpoint[1]), ENGINE), ids, [image])}
    print(f"qwen2.5-vl perplexity: {ppl}")
    assert ppl["int8"] <= ppl["float32"] * INT8_PPL_RATIO


def test_artifacts_round_trip_with_no_compiles(tmp_path, checkpoint, loaded, batch):
    """warm-cache's artifacts hold every patch bucket's encoder graph: an engine from them
    compiles nothing and gives transformers' tokens."""
    import json

    from maxjax.aot import export as aot_export, load as aot_load
    from maxjax.engine import compile_counter
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.core import EngineCore
    from maxjax.engine.plan import plan_engine
    flags = EngineConfig(**ENGINE)
    d = tmp_path / "artifacts"
    d.mkdir()
    aot_export.write_artifacts(str(d), loaded, plan_engine(flags, loaded), ["cpu"],
                               progress=False)
    names = {g["name"] for g in json.loads((d / "manifest.json").read_text())["graphs"]}
    assert {"vision_16", "vision_32", "vision_64"} <= names
    before = compile_counter.count()
    plan, exes, kv_init, vision = aot_load.load_planned([str(d)], loaded, flags)
    fresh = EngineCore(loaded, plan, exes, kv_init, vision)
    fresh.warmup()
    requests, pngs = batch
    got = _run(fresh, {"b3": requests["b"]})
    assert got["b3"] == _hf_greedy(checkpoint[0], requests["b"][0], pngs["b"])
    assert compile_counter.count() == before
