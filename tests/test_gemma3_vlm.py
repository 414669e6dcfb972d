"""Gemma 3 reading images (graphs/gemma3_vlm.py) against transformers' Gemma3ForConditionalGeneration
on a tiny random checkpoint: two different PNG images made here, in one batch, through the
engine; the same prompt with another image is not served from the prefix cache; artifacts round
trip with 0 compiles; an image split across prefill chunks is not allowed."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from maxjax.engine.types import SamplingParams
from vlm_helpers import engine_core, load, png as _png, write_word_tokenizer

pytestmark = pytest.mark.slow

IMAGE, BOI, EOI = 250, 251, 252
VOCAB, NEW_TOKENS = 256, 12
SPECIAL = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
           "eoi_token": "<end_of_image>"}
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=96, num_kv_pages=48,
              kv_cache_page_size=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor,
                              Gemma3TextConfig, SiglipVisionConfig)
    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=32, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"],
                                     eos_token_id=None, bos_token_id=1),
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         image_size=32, patch_size=8),
        mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():    # the init zeroes or ones some: make every parameter matter
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    path = tmp_path_factory.mktemp("gemma3_vlm")
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB, SPECIAL, {"image_token": IMAGE, "boi_token": BOI,
                                                "eoi_token": EOI})
    Gemma3ImageProcessor(size={"height": 32, "width": 32},
                         do_pan_and_scan=False).save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load(checkpoint[1])


@pytest.fixture(scope="module")
def core(loaded):
    return engine_core(loaded, ENGINE)


def _prompt(model, words: str) -> tuple[list[int], str]:
    text = model.vision.spec.expand_prompt(model.vision.config, model.tokenizer,
                                           f"w5 w6 {SPECIAL['boi_token']} {words}", [None])
    return model.tokenizer.encode(text, add_special_tokens=False), text


def _hf_greedy(hf_model, ids, png: bytes) -> list[int]:
    from PIL import Image
    from transformers import Gemma3ImageProcessor
    pixels = Gemma3ImageProcessor(size={"height": 32, "width": 32}, do_pan_and_scan=False)(
        [Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")["pixel_values"]
    ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                pixel_values=pixels, token_type_ids=(ids == IMAGE).long(),
                                max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def _run(core, requests: dict) -> tuple[dict, dict]:
    """request id -> (prompt ids, [ImageInput]), run together -> (id -> tokens, id -> cached
    prompt tokens)."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for rid, (ids, images) in requests.items():
        core.add_request(rid, ids, greedy, images=images)
    tokens: dict = {rid: [] for rid in requests}
    cached: dict = {}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                cached[out.request_id] = out.cached_tokens
    return tokens, cached


def test_two_images_in_one_batch_match_transformers(checkpoint, loaded, core):
    from maxjax.models.vision import read_image
    hf_model = checkpoint[0]
    pngs = [_png(1, (40, 56, 3)), _png(2, (32, 32, 3))]
    images = [read_image(loaded.vision, p) for p in pngs]
    assert images[0].key != images[1].key and images[0].num_tokens == 4
    a, _ = _prompt(loaded, "w7 w8 w9 w10 w11 w12 w13 w14")
    b, _ = _prompt(loaded, "w20 w21 w22")
    got, _ = _run(core, {"a": (a, [images[0]]), "b": (b, [images[1]]),
                         "text": ([5, 6, 7, 8, 9], None)})
    assert got["a"] == _hf_greedy(hf_model, a, pngs[0])
    assert got["b"] == _hf_greedy(hf_model, b, pngs[1])
    assert got["a"] != got["b"]
    assert core.step_compiles == 0


def test_prompt_logprobs_match_transformers_image_attended_both_ways(checkpoint, loaded, core):
    """Logprobs of every prompt token after an image, in a prompt split over several chunks:
    an image's tokens see each other both ways (causal image attention moves them by ~0.5)."""
    from maxjax.models.vision import read_image
    png = _png(3, (48, 48, 3))
    ids, _ = _prompt(loaded, " ".join(f"w{i}" for i in range(30, 50)))
    params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=True)
    core.add_request("lp", ids, params, images=[read_image(loaded.vision, png)])
    got = None
    while core.has_unfinished():
        for out in core.step():
            got = out.prompt_logprobs or got
    from PIL import Image
    from transformers import Gemma3ImageProcessor
    pixels = Gemma3ImageProcessor(size={"height": 32, "width": 32}, do_pan_and_scan=False)(
        [Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")["pixel_values"]
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = checkpoint[0](input_ids=x, pixel_values=pixels,
                               token_type_ids=(x == IMAGE).long()).logits[0]
    want = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None])[:, 0].numpy()
    mine = np.array([lp.logprob for lp in got[1:]])
    assert len(ids) > ENGINE["max_batch_input_tokens"]          # prefilled in chunks
    np.testing.assert_allclose(mine, want, atol=1e-3)


def test_another_image_is_not_served_from_the_prefix_cache(loaded, core):
    """The same prompt with another image reuses only the pages before the image; with the
    same image again, the pages through the image."""
    from maxjax.models.vision import read_image
    ids, _ = _prompt(loaded, " ".join(f"w{i}" for i in range(60, 80)))
    start = ids.index(IMAGE)
    first, second = (read_image(loaded.vision, _png(s, (32, 32, 3))) for s in (10, 11))
    ps = ENGINE["kv_cache_page_size"]
    got, cached = _run(core, {"first": (ids, [first])})
    assert cached["first"] <= start // ps * ps        # nothing cached yet beyond a text prefix
    got2, cached2 = _run(core, {"second": (ids, [second])})
    assert cached2["second"] <= start // ps * ps      # the other image's pages are not reused
    assert got2["second"] != got["first"]
    got3, cached3 = _run(core, {"again": (ids, [first])})
    assert cached3["again"] > start + 4               # the same image: its pages are reused
    assert got3["again"] == got["first"]


def test_artifacts_round_trip_with_no_compiles(tmp_path, checkpoint, loaded, core):
    """warm-cache's artifacts hold the image encoder's graph: a server from them compiles
    nothing, and gives the same tokens."""
    from maxjax.aot import export as aot_export, load as aot_load
    from maxjax.engine import compile_counter
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.core import EngineCore
    from maxjax.engine.plan import plan_engine
    from maxjax.models.vision import read_image
    flags = EngineConfig(**ENGINE)
    d = tmp_path / "artifacts"
    d.mkdir()
    aot_export.write_artifacts(str(d), loaded, plan_engine(flags, loaded), ["cpu"],
                               progress=False)
    names = [g["name"] for g in json.loads((d / "manifest.json").read_text())["graphs"]]
    assert "vision_1" in names
    before = compile_counter.count()
    plan, exes, kv_init, vision = aot_load.load_planned([str(d)], loaded, flags)
    fresh = EngineCore(loaded, plan, exes, kv_init, vision)
    fresh.warmup()
    assert {e.source for e in vision.values()} == {"executable"}
    image = read_image(loaded.vision, _png(1, (40, 56, 3)))
    ids, _ = _prompt(loaded, "w7 w8 w9 w10 w11 w12 w13 w14")
    got, _ = _run(fresh, {"a": (ids, [image])})
    want, _ = _run(core, {"a2": (ids, [image])})
    assert got["a"] == want["a2"]
    assert compile_counter.count() == before


def test_int8_perplexity_within_bound(checkpoint, loaded, core):
    from maxjax.models.vision import read_image
    from vlm_helpers import INT8_PPL_RATIO, int8_core, perplexity
    image = read_image(loaded.vision, _png(4, (40, 40, 3)))
    ids, _ = _prompt(loaded, " ".join(f"w{i}" for i in range(80, 100)))
    ppl = {"float32": perplexity(core, ids, [image]),
           "int8": perplexity(int8_core(str(checkpoint[1]), ENGINE), ids, [image])}
    print(f"gemma3 vlm perplexity: {ppl}")
    assert ppl["int8"] <= ppl["float32"] * INT8_PPL_RATIO


TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<start_of_image> {% else %}{{ p['text'] }} {% endif %}{% endfor %}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<s> model {% endif %}")


@pytest.fixture(scope="module")
def server(core, loaded):
    """The module's engine behind the OpenAI server (the last tests: it owns the core now)."""
    from server_harness import ServerThread

    from maxjax.engine.async_engine import AsyncEngine
    from maxjax.server.config import ServeConfig
    eng = AsyncEngine(core, loaded.tokenizer, "tiny-vlm", TEMPLATE)
    eng.start()
    srv = ServerThread(eng, ServeConfig(max_images_per_request=2))
    yield srv
    srv.close()
    eng.shutdown()


def _chat(server, parts: list, **kw):
    import openai
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(
        model="tiny-vlm", messages=[{"role": "user", "content": parts}], max_tokens=6,
        temperature=0, **kw)


def _data_url(png: bytes) -> dict:
    import base64
    return {"type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}


def test_server_reads_data_url_images(server):
    text = {"type": "text", "text": "w40 w41 w42"}
    a1, b, a2 = (_chat(server, [text, _data_url(_png(seed, (32, 40, 3)))], logprobs=True)
                 for seed in (20, 21, 20))

    def first_logprob(r):
        return r.choices[0].logprobs.content[0].logprob
    assert a1.choices[0].message.content == a2.choices[0].message.content
    assert first_logprob(a1) == pytest.approx(first_logprob(a2), abs=1e-5)
    assert first_logprob(a1) != pytest.approx(first_logprob(b), abs=1e-3)
    assert a1.usage.prompt_tokens == b.usage.prompt_tokens > 4     # the image's 4 tokens
    assert a2.usage.prompt_tokens_details.cached_tokens > \
        b.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "does not fetch remote images"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
     "not an image"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
     "--allowed-local-media-path"),
    ({"type": "image_url", "image_url": {}}, "needs a 'url'"),
])
def test_server_refuses_a_bad_image_naming_the_part(server, part, message):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, [{"type": "text", "text": "w40"}, part])
    assert message in str(e.value) and "messages[0].content[1]" in str(e.value)


def test_server_limits_images_per_request(server):
    import openai
    image = _data_url(_png(22, (32, 32, 3)))
    with pytest.raises(openai.BadRequestError, match="--max-images-per-request"):
        _chat(server, [image, image, image])


def test_responses_and_messages_apis_take_images(server):
    """The Responses API's input_image and the Anthropic Messages API's image block reach the
    model as the chat API's image_url does: the same prompt, the same first logprob."""
    import base64

    import anthropic
    import openai
    png = _png(23, (32, 32, 3))
    b64 = base64.b64encode(png).decode()
    chat = _chat(server, [{"type": "text", "text": "w40"}, _data_url(png)], logprobs=True)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    resp = client.responses.create(model="tiny-vlm", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "w40"},
                                     {"type": "input_image",
                                      "image_url": f"data:image/png;base64,{b64}"}]}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    msg = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0).messages.create(
        model="tiny-vlm", max_tokens=6, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "w40"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64}}]}])
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
