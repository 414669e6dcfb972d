"""Qwen3-Next (graphs/qwen3_next.py) and Qwen3.5 dense and MoE (graphs/qwen3_5.py) against
transformers on tiny random checkpoints: 4 layers, Gated DeltaNet at 0 and 2 (2 key heads
serving 4 value heads, a 4-tap conv) and gated attention at 1 and 3 (half-rotary), Qwen3-Next's
layer 0 dense and the others routed (8 experts, top 2, the gated shared expert), Qwen3.5-MoE's
all routed. Two prompts prefilled in chunks of 8 in one batch (the chunk boundaries inside the
prompts: the DeltaNet state and the conv's last inputs carried across them), 32 greedy
tokens each."""
from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import torch

from engine_runs import run_preempting, run_tokens
from paged_harness import load_checkpoint, paged_greedy
from reference import assert_logits_close, hf_generate, hf_greedy
from tiny_llama import write_word_tokenizer

pytestmark = pytest.mark.slow      # three checkpoints' graphs and 3 x 64 transformers steps: ~90 s

VOCAB, NEW_TOKENS = 256, 32
# float32 throughout. transformers prefills the DeltaNet in chunks of 64 (a triangular solve)
# and decodes one token at a time; here every token is one step of the recurrence: the same
# sums in another order (measured ~1e-6 of the largest logit). A wrong head grouping, gate or
# norm moves logits by ~1e-1 of it.
LOGIT_REL_TOL = 1e-3
LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
              linear_num_value_heads=4, layer_types=LAYERS, max_position_embeddings=512,
              eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5})
ROUTED = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
              num_experts_per_tok=2)


def _model(family: str):
    import transformers as T
    if family == "qwen3_next":
        cfg = T.Qwen3NextConfig(**COMMON, **ROUTED, intermediate_size=96, mlp_only_layers=[0])
        return T.Qwen3NextForCausalLM(cfg)
    if family == "qwen3_5":
        return T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**COMMON, intermediate_size=96))
    return T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**COMMON, **ROUTED))


def scramble(model):
    """Initialization leaves logits near 0 and (1 + w) norms at 1: make every parameter count."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("dt_bias"):
                p.add_(0.2 * torch.randn_like(p))
            elif not name.endswith("A_log"):      # log of uniform(0.01, 16) already
                p.normal_(0.0, 0.15)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def checkpoint(request, tmp_path_factory):
    """(family, transformers model, directory of its float32 checkpoint and a tokenizer)."""
    torch.manual_seed(0)
    model = scramble(_model(request.param))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return request.param, model, str(path)


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(3, VOCAB, n))) for n in (13, 29)]


def test_config_and_pools(checkpoint):
    from maxjax.graphs import decoder
    family, _, path = checkpoint
    _, cfg, params = load_checkpoint(path)
    assert cfg.state_layers == (True, False, True, False) and cfg.rotary_dim == 8
    assert (cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_groups, cfg.ssm_state_dim,
            cfg.ssm_conv_kernel) == (4, 12, 2, 8, 4)
    assert cfg.norm_plus_one and cfg.qk_norm
    routed = {"qwen3_next": (False, True, True, True), "qwen3_5": (),
              "qwen3_5_moe": (True,) * 4}[family]
    assert cfg.moe_layers == routed
    if routed:
        assert params["layers"][1]["shared_gate"].shape == (64, 1)
    assert params["layers"][0]["w_in"].shape == (64, 2 * 16 + 2 * 48 + 2 * 4)
    assert params["layers"][0]["conv_w"].shape == (80, 4)
    assert params["layers"][1]["w_gate"].shape == (64, 64)
    k, v, conv, rec = decoder.kv_pool_specs(cfg, 10, 8, state_slots=3)
    assert k.shape == v.shape == (2, 10, 2, 8, 16)          # the two attention layers
    assert conv.shape == (2, 3, 80, 3) and rec.shape == (2, 3, 4, 8, 12)


def test_paged_graph_matches_transformers(checkpoint):
    """The 29-token prompt prefilled in chunks of 8 beside the 13-token one (pages of 8), then
    32 greedy tokens each, batched: transformers' logits and tokens."""
    _, model, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    prompts = _prompts()
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=8, new_tokens=NEW_TOKENS,
                                  page_size=8)
    for prompt, lg, tk in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_greedy(model, prompt, NEW_TOKENS)
        assert_logits_close(lg, ref_logits, rel=LOGIT_REL_TOL)
        assert tk == ref_tokens


def test_hub_layout_loads_the_same(checkpoint, tmp_path):
    """A hub Qwen3.5 checkpoint: the image-text wrapper's config.json (the text model under
    text_config), the weights under model.language_model., a vision tower's and MTP's tensors
    beside them, the experts as stacks [E, out, in]: the same config and parameters."""
    from safetensors.numpy import load_file, save_file
    family, _, path = checkpoint
    if family == "qwen3_next":
        pytest.skip("Qwen3-Next checkpoints are text-only")
    hub = tmp_path / "hub"
    shutil.copytree(path, hub)
    with open(hub / "config.json") as f:
        text = json.load(f)
    arch = text.pop("architectures")[0].replace("ForCausalLM", "ForConditionalGeneration")
    tie = text.pop("tie_word_embeddings")
    with open(hub / "config.json", "w") as f:
        json.dump({"architectures": [arch], "model_type": family, "text_config": text,
                   "vision_config": {"depth": 1}, "tie_word_embeddings": tie}, f)
    tensors = load_file(hub / "model.safetensors")
    out = {"mtp.fc.weight": np.zeros((4, 4), np.float32),
           "model.visual.patch_embed.proj.weight": np.zeros((4, 4), np.float32)}
    experts = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:          # model.layers.{i}.mlp.experts.{j}.{proj}.weight
            head, j, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            experts.setdefault(head, {}).setdefault(proj, {})[j] = t
            continue
        out[name.replace("model.", "model.language_model.", 1)] = t
    for head, projs in experts.items():
        head = head.replace("model.", "model.language_model.", 1)
        E = len(projs["down_proj"])
        out[head + ".gate_up_proj"] = np.stack([np.concatenate(
            [projs["gate_proj"][j], projs["up_proj"][j]]) for j in range(E)])
        out[head + ".down_proj"] = np.stack([projs["down_proj"][j] for j in range(E)])
    save_file(out, hub / "model.safetensors")
    arch_hub, cfg_hub, params_hub = load_checkpoint(str(hub))
    _, cfg, params = load_checkpoint(path)
    assert arch_hub.name == arch and cfg_hub.state_layers == cfg.state_layers
    assert cfg_hub.moe_layers == cfg.moe_layers
    flat, flat_hub = jax.tree.leaves_with_path(params), jax.tree.leaves(params_hub)
    assert len(flat) == len(flat_hub)
    for (where, a), b in zip(flat, flat_hub):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(where))


# --max-batch-input-tokens 16 cuts the 29-token prompt at 16 and the batch's prompts wherever
# the budget ends; pages of 8 tokens; a state slot a row.
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=96, num_kv_pages=48,
              kv_cache_page_size=8)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(transformers model, an EngineCore on its checkpoint): Qwen3-Next, whose layers are of
    every kind the three families have (DeltaNet, attention, dense and routed MLPs)."""
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    from maxjax.models.loader import load_model
    torch.manual_seed(0)
    model = scramble(_model("qwen3_next"))
    path = tmp_path_factory.mktemp("qwen3_next_engine")
    model.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return model, build_core(load_model(str(path), "float32", progress=False),
                             EngineConfig(**ENGINE))


def _engine_prompts():
    return [_prompts()[0][:5], *_prompts()]


def _hf_generate(model, prompt):
    return hf_generate(model, prompt, NEW_TOKENS)


def test_engine_holds_attention_pages_and_state_slots(engine):
    k, v, conv, rec = jax.tree.leaves(engine[1].runner.kv)
    slots = 2 * ENGINE["max_batch_size"] + 1    # scratch, one a row, a prefix-cache snapshot a row
    assert k.shape == v.shape == (2, ENGINE["num_kv_pages"], 2, 8, 16)
    assert conv.shape == (2, slots, 80, 3) and rec.shape == (2, slots, 4, 8, 12)


def test_engine_batched_chunked_equals_transformers_generate(engine):
    """Three prompts batched, 32 greedy tokens each; the 29-token prompt is prefilled in
    chunks of at most 16 tokens (its state carried from chunk to chunk)."""
    from maxjax.engine.types import SamplingParams
    model, core = engine
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _engine_prompts()
    tokens, steps = run_tokens(core, {f"r{i}": p for i, p in enumerate(prompts)}, greedy)
    assert steps > NEW_TOKENS                     # the prompts took more than one step
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == _hf_generate(model, prompt), i


def test_engine_recomputed_after_preemption(engine):
    """A request preempted mid-decode (its slot given back, its state gone) recomputes its
    prompt and its tokens so far from zero state, beside another request."""
    from maxjax.engine.types import SamplingParams
    model, core = engine
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _engine_prompts()
    tokens = run_preempting(core, {"pre": prompts[2], "other": prompts[1]}, greedy, "pre")
    assert tokens["pre"] == _hf_generate(model, prompts[2])
    assert tokens["other"] == _hf_generate(model, prompts[1])


def test_list_shows_the_families_and_their_state(capsys):
    from maxjax import cli
    assert cli.main(["list", "--json"]) == 0
    rows = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    for name in ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                 "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        assert (rows[name]["state"], rows[name]["request_state"]) == ("kv", "recurrent"), name
