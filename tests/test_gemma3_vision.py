"""graphs/gemma3_vision.py against transformers: a tiny random Gemma3ForConditionalGeneration's
get_image_features on two images from Gemma3ImageProcessor, the parameter shapes, config errors,
and the prompt expansion against Gemma3Processor's."""
from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest
import torch

from maxjax.graphs import gemma3_vision as gv

TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
          "eoi_token": "<end_of_image>"}
TOLERANCE = 1e-4     # max abs error over max abs value, float32


def _image_processor():
    from transformers import Gemma3ImageProcessor
    return Gemma3ImageProcessor(size={"height": 32, "width": 32}, do_pan_and_scan=False)


def _images():
    import PIL.Image
    rng = np.random.default_rng(0)
    return [PIL.Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
            for shape in ((40, 56, 3), (32, 32, 3))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                              SiglipVisionConfig)
    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=256, hidden_size=48, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=24),
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         image_size=32, patch_size=8),
        mm_tokens_per_image=4, image_token_id=250, boi_token_index=251, eoi_token_index=252)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():    # the init zeroes or ones some: make every parameter matter
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                p.add_(torch.randn_like(p) * (0.5 if p.ndim == 1 else 0.2))
    path = tmp_path_factory.mktemp("gemma3_vision")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    from safetensors import safe_open
    _, path = checkpoint
    hf = json.loads((path / "config.json").read_text())
    vcfg = gv.vision_config_from_hf(hf)
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        params = gv.vision_params_from_hf(vcfg, f.get_tensor, "float32")
    return vcfg, params


def test_config_from_hf(loaded):
    vcfg = loaded[0]
    assert vcfg == gv.VisionConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
        mm_tokens_per_image=4, text_hidden_size=48, image_token_id=250, boi_token_id=251,
        eoi_token_id=252)
    assert hash(vcfg) == hash(gv.VisionConfig(**vcfg.to_dict()))


def test_encode_images_matches_transformers(checkpoint, loaded):
    model, _ = checkpoint
    vcfg, params = loaded
    pixels = _image_processor()(_images(), return_tensors="np")["pixel_values"]
    assert pixels.shape == (2, 3, 32, 32)
    with torch.no_grad():
        out = model.model.get_image_features(torch.tensor(pixels))
    want = (out if isinstance(out, torch.Tensor) else out.pooler_output).numpy()
    encode = jax.jit(functools.partial(gv.encode_images, vcfg))
    got = np.asarray(encode(params, jax.numpy.asarray(pixels)))
    assert got.shape == want.shape == (2, 4, 48) and got.dtype == np.float32
    assert not np.allclose(want[0], want[1])
    rel = np.abs(got - want).max() / np.abs(want).max()
    print(f"gemma3 vision: max abs error / max abs value = {rel:.2e}")
    assert rel <= TOLERANCE


def test_param_shapes_match_loaded(loaded):
    vcfg, params = loaded
    shapes = gv.vision_param_shapes(vcfg)
    assert jax.tree.map(lambda a: tuple(a.shape), params) == shapes


def test_checkpoint_names_in_the_original_layout(checkpoint, loaded):
    from safetensors import safe_open
    vcfg, params = loaded
    with safe_open(str(checkpoint[1] / "model.safetensors"), framework="numpy") as f:
        # the hub's Gemma 3 checkpoints: vision_tower.vision_model.*
        def get(name):
            return f.get_tensor(name.replace("vision_tower.vision_model.", "vision_tower."))
        again = gv.vision_params_from_hf(vcfg, get, "float32")
    jax.tree.map(np.testing.assert_array_equal, params, again)


def test_missing_vision_config_raises(checkpoint):
    hf = json.loads((checkpoint[1] / "config.json").read_text())
    del hf["vision_config"]
    with pytest.raises(ValueError, match="vision_config"):
        gv.vision_config_from_hf(hf)
    with pytest.raises(ValueError, match="vision_config"):
        gv.vision_config_from_hf(hf["text_config"])


def test_expand_image_prompt_matches_processor(loaded):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    vcfg = loaded[0]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)   # lossless decode
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(byte_level.alphabet())}, []))
    tok.pre_tokenizer, tok.decoder = byte_level, decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, extra_special_tokens=TOKENS)
    processor = Gemma3Processor(image_processor=_image_processor(), tokenizer=tokenizer,
                                image_seq_length=vcfg.mm_tokens_per_image)
    prompt = "Compare <start_of_image> with\n<start_of_image>: which is brighter?"
    ids = processor(images=[_images()], text=[prompt], return_tensors="np")["input_ids"][0]
    ours = gv.expand_image_prompt(prompt, 2, vcfg, **TOKENS)
    assert tokenizer.decode(ids) == ours
    assert list(ids) == tokenizer(ours)["input_ids"]
    assert ours.count(TOKENS["image_token"]) == 2 * vcfg.mm_tokens_per_image
    with pytest.raises(ValueError):
        gv.expand_image_prompt(prompt, 1, vcfg, **TOKENS)


def test_bfloat16_params_give_bfloat16_tokens(checkpoint, loaded):
    from safetensors import safe_open
    vcfg, params = loaded
    with safe_open(str(checkpoint[1] / "model.safetensors"), framework="numpy") as f:
        bf16 = gv.vision_params_from_hf(vcfg, f.get_tensor, "bfloat16")
    pixels = _image_processor()(_images(), return_tensors="np")["pixel_values"]
    encode = jax.jit(gv.encode_images, static_argnums=0)
    want = np.asarray(encode(vcfg, params, pixels))
    got = encode(vcfg, bf16, pixels)
    assert got.dtype == jax.numpy.bfloat16
    rel = np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max()
    assert rel < 5e-2, rel


def test_long_images_attend_in_query_blocks_with_the_same_result():
    """Gemma 3's 4096 patches take the blocked attention; it equals one softmax."""
    rng = np.random.default_rng(0)
    q, k, v = (jax.numpy.asarray(rng.standard_normal((2, 1024, 4, 16), np.float32))
               for _ in range(3))
    want = jax.nn.dot_product_attention(q, k, v, scale=0.25)
    np.testing.assert_allclose(gv._attention(q, k, v, 0.25), want, atol=1e-5)
