"""SmolLM2-135M real weights (the embedded GGUF): our GGUF loader + Llama graph against transformers'
own GGUF loader + PyTorch model, through chunked prefill and greedy decode on the paged KV cache;
and the same model saved as an HF directory loads to the same parameters and logits."""
import json
import os

import jax
import numpy as np
import pytest

from maxjax.models.loader import embedded_model_path, load_model
from paged_harness import paged_greedy
from reference import assert_logits_close, hf_greedy

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

NEW_TOKENS = 32
CHUNK = 32      # every prompt below is longer, so each prefills in >= 2 chunks
PAGE = 16

LONG_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring plugboards; later, stored programs let the same hardware run many tasks. Assembly "
    "languages gave names to instructions, and compilers translated higher-level languages into "
    "those instructions, so that programmers could think about algorithms instead of registers. "
    "Operating systems hid the details of devices behind files and processes. Networks connected "
    "machines, and protocols layered on top of one another let programs talk across continents "
    "without knowing anything about the cables in between. Databases separated the logical view "
    "of data from its physical storage. Each layer made the next generation of software possible, "
    "and each layer also introduced new ways for things to go wrong. Today, machine learning "
    "systems add yet another layer: models trained on data rather than written by hand. Explain, "
    "in a few sentences, why abstraction matters for building reliable software systems, and "
    "give one example from networking and one from databases where a leaky abstraction caused "
    "real trouble for the engineers who depended on it.")


@pytest.fixture(scope="module")
def ours():
    return load_model(None, "float32", progress=False)


@pytest.fixture(scope="module")
def reference():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM
    directory, name = os.path.split(embedded_model_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(ours):
    tok = ours.tokenizer

    def chat(text):
        return tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)).input_ids

    out = [chat("What is the capital of France? Answer in one sentence and then name two museums."),
           tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, iteratively.\"\"\"\n"
               "    a, b = 0, 1\n    for _ in range(n):\n").input_ids,
           chat(LONG_TEXT)]
    assert all(len(p) > CHUNK for p in out) and max(len(p) for p in out) > 200
    return out


@pytest.fixture(scope="module")
def ours_run(ours, prompts):
    return paged_greedy(ours.arch, ours.config, ours.params, prompts, CHUNK, NEW_TOKENS, PAGE)


def test_config_from_gguf(ours):
    cfg = ours.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size) == ("LlamaForCausalLM", 30, 576, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert "<|im_start|>" in ours.chat_template


def test_tokenizer_matches_transformers(ours):
    # transformers' GGUF tokenizer path (what AutoTokenizer builds for this file, without its
    # ~8 s detour through gguf's reader to derive a model config)
    from transformers import TokenizersBackend
    directory, name = os.path.split(embedded_model_path())
    ref = TokenizersBackend.from_pretrained(directory, gguf_file=name)
    for text in ["Hello world", "  spaces\n\nand ünïcödé — 12345 <|im_start|>user\nhi<|im_end|>", ""]:
        assert ours.tokenizer(text).input_ids == ref(text).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert (ours.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert ours.tokenizer.eos_token == ref.eos_token == "<|im_end|>"


def test_weights_equal_transformers(ours, reference):
    """Every tensor transformers dequantizes equals ours (bit for bit), Q/K un-permutation included."""
    from maxjax.models import gguf
    _, reader, _, _ = gguf.open_gguf(ours.source)
    state = reference.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight":    # tied to the embedding
            continue
        np.testing.assert_array_equal(reader(name), tensor.float().numpy(), err_msg=name)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_greedy_parity_with_transformers(ours_run, reference, prompts, i):
    logits, tokens = ours_run
    ref_logits, ref_tokens = hf_greedy(reference, prompts[i], NEW_TOKENS)
    assert tokens[i] == ref_tokens
    assert_logits_close(logits[i], ref_logits, rel=1e-3)


def test_hf_directory_matches_gguf(ours, reference, prompts, tmp_path_factory):
    """transformers' model saved as an HF checkpoint (config.json + safetensors + tokenizer) loads
    to the same architecture, config and parameters as the GGUF, hence the same logits (the graph
    is a pure function of the three: test_greedy_parity_with_transformers checks the GGUF's)."""
    from safetensors.torch import save_file
    directory = tmp_path_factory.mktemp("smollm2_hf")
    config = reference.config.to_dict()
    config.pop("quantization_config", None)    # transformers refuses save_pretrained on GGUF loads
    config["architectures"] = ["LlamaForCausalLM"]
    with open(directory / "config.json", "w") as f:
        json.dump(config, f)
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))
    ours.tokenizer.save_pretrained(str(directory))

    from_dir = load_model(str(directory), "float32", progress=False)
    assert from_dir.arch is ours.arch and from_dir.config == ours.config
    assert from_dir.chat_template == ours.chat_template
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        from_dir.params, ours.params)
    assert all(jax.tree.leaves(same)), same
    prompt = prompts[1]
    assert from_dir.tokenizer(ours.tokenizer.decode(prompt)).input_ids == prompt


def test_lora_adapter_parity_with_peft(ours, reference, prompts, tmp_path_factory):
    """A random PEFT adapter on every projection: our stacked-slot graph (adapter in slot 1 of 2,
    rows of the base model and of the adapter in the same steps) against peft + transformers."""
    import copy
    from types import SimpleNamespace

    import torch
    from peft import LoraConfig, get_peft_model
    from maxjax.lora.manager import LoraManager
    torch.manual_seed(0)                        # PEFT's A init
    peft_model = get_peft_model(copy.deepcopy(reference), LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj",
                                                               "o_proj", "gate_proj", "up_proj",
                                                               "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    path = str(tmp_path_factory.mktemp("smol_lora"))
    peft_model.save_pretrained(path)
    lora = LoraManager(ours.config, np.float32, 2, 8, 1)
    lora.load("x", path)
    pin = SimpleNamespace(adapter_id=lora.resolve("x"), lora_slot=0)
    lora.acquire(pin)
    new = 8
    logits, tokens = paged_greedy(ours.arch, ours.config, {**ours.params, "lora": lora.device},
                                  [prompts[0], prompts[0]], CHUNK, new, PAGE,
                                  lora_slots=[pin.lora_slot, 0])
    ref_logits, ref_tokens = hf_greedy(peft_model.eval(), prompts[0], new)
    base_logits, base_tokens = hf_greedy(reference, prompts[0], new)
    assert tokens[0] == ref_tokens and tokens[1] == base_tokens
    assert_logits_close(logits[0], ref_logits, rel=1e-3)
    assert_logits_close(logits[1], base_logits, rel=1e-3)
    # the adapter moves the logits 20x more than the parity tolerance allows
    assert float(np.max(np.abs(ref_logits - base_logits))) > 0.02 * float(np.max(np.abs(base_logits)))
