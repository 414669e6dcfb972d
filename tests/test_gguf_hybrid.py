"""GGUF files of the hybrid families (Qwen3-Next, Qwen3.5 dense and MoE, Granite 4) written
from tiny random transformers checkpoints the way llama.cpp's convert_hf_to_gguf.py writes them
(its Qwen3NextModel, Qwen3_5TextModel / Qwen3_5MoeTextModel with their value heads tiled, and
GraniteHybridModel: -exp(A_log), squeezed conv taps, norms with +1 but the DeltaNet's, q|k|v|z
regrouped, gate and up apart, experts stacked), gguf-py naming the rest. Through
maxjax/models/gguf.py they load to the HF checkpoint's parameters, and decode transformers'
greedy tokens; Q8_0 matrices load within Q8_0's rounding."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gguf_common import write_common_header
from maxjax.models import gguf as G
from maxjax.models import registry
from paged_harness import load_checkpoint, paged_greedy
from reference import assert_logits_close, hf_greedy

pytestmark = pytest.mark.slow      # four checkpoints, their GGUFs and two greedy runs: ~60 s

NEW_TOKENS = 16
ARCH = {"qwen3_next": "qwen3next", "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe",
        "granite": "granitehybrid"}


def _model(family: str):
    torch.manual_seed(0)
    if family == "granite":
        import test_granitemoehybrid as t
        # llama.cpp runs Granite 4 without rope (the converter clears rope.scaling.finetuned)
        return t._model(0, position_embedding_type=None)
    import test_qwen3_next as t
    if family == "qwen3_next":    # llama.cpp's qwen3next routes every layer
        import transformers as T
        cfg = T.Qwen3NextConfig(**t.COMMON, **t.ROUTED, intermediate_size=96)
        return t.scramble(T.Qwen3NextForCausalLM(cfg))
    return t.scramble(t._model(family))


def _tiled(w: np.ndarray, c, width: int, axis: int = 0) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: grouped value heads to tiled."""
    G_, H = c.linear_num_key_heads, c.linear_num_value_heads
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(G_, H // G_, width, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(w, 0, axis)


def _qwen_tensors(c, name: str, t: np.ndarray, qwen35: bool):
    """(GGUF-bound HF name or GGUF name, tensor) pairs for one checkpoint tensor."""
    qk = 2 * c.linear_num_key_heads * c.linear_key_head_dim
    dv = c.linear_value_head_dim
    if qwen35 and "linear_attn." in name:
        if ".in_proj_qkv." in name or ".conv1d." in name:
            t = np.concatenate([t[:qk], _tiled(t[qk:], c, dv)])
        elif ".in_proj_z." in name:
            t = _tiled(t, c, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log",
                                                                                  ".dt_bias")):
            t = _tiled(t, c, 1)
        elif ".out_proj." in name:
            t = _tiled(t, c, dv, axis=1)
    if name.endswith(".A_log"):
        t = -np.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if "in_proj_qkvz.weight" in name:        # [q, k, v, z] per key head -> q | k | v, z
        D = t.shape[1]
        w = t.reshape(c.linear_num_key_heads, -1, D)
        dk = c.linear_key_head_dim
        rv = t.shape[0] // c.linear_num_key_heads // 2 - dk
        q, k, v, z = np.split(w, [dk, 2 * dk, 2 * dk + rv], axis=1)
        bid = name.split(".")[2]
        return [(f"blk.{bid}.attn_qkv.weight",
                 np.concatenate([x.reshape(-1, D) for x in (q, k, v)])),
                (f"blk.{bid}.attn_gate.weight", z.reshape(-1, D))]
    return [(name, t)]


def _granite_tensors(c, name: str, t: np.ndarray):
    bid = name.split(".")[2] if name.startswith("model.layers.") else None
    if name.endswith("input_linear.weight"):
        kind = "exps" if "block_sparse_moe" in name else "shexp"
        gate, up = np.split(t, 2, axis=-2)
        return [(f"blk.{bid}.ffn_gate_{kind}.weight", gate), (f"blk.{bid}.ffn_up_{kind}.weight", up)]
    if name.endswith("shared_mlp.output_linear.weight"):
        return [(f"blk.{bid}.ffn_down_shexp.weight", t)]
    if name.endswith(".dt_bias"):
        return [(name.rpartition(".dt_bias")[0] + ".dt_proj.bias", t)]
    if "conv1d.weight" in name:
        return [(name, t.squeeze())]
    if name.endswith((".A_log", ".D")):
        t = t.reshape(*t.shape, 1)
        return [(name, -np.exp(t) if name.endswith(".A_log") else t)]
    if name.endswith("mamba.norm.weight"):
        return [(name, t.reshape(c.mamba_n_groups, -1))]
    if name.endswith(("q_proj.weight", "k_proj.weight")):   # LlamaModel.permute
        heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
        t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2)
        t = t.reshape(-1, c.hidden_size)
    return [(name, t)]


def write_gguf(path, model, family: str, qtype=None) -> str:
    """convert_hf_to_gguf.py's file for the model (F32; `qtype`: its 2-D matrices quantized)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file
    c, arch = model.config, ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    if family == "granite":
        write_common_header(w, c)
        w.add_head_count_kv([c.num_key_value_heads if "attention" in t and "linear" not in t
                             else 0 for t in c.layer_types])
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
        w.add_ssm_conv_kernel(c.mamba_d_conv)
        w.add_ssm_state_size(c.mamba_d_state)
        w.add_ssm_group_count(c.mamba_n_groups)
        w.add_ssm_inner_size(c.mamba_n_heads * c.mamba_d_head)
        w.add_ssm_time_step_rank(c.mamba_n_heads)
        w.add_rope_scaling_finetuned(False)
    else:
        if not hasattr(c, "intermediate_size") or c.intermediate_size is None:
            c.intermediate_size = 0
        write_common_header(w, c)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
        w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
        w.add_ssm_state_size(c.linear_key_head_dim)
        w.add_ssm_group_count(c.linear_num_key_heads)
        w.add_ssm_time_step_rank(c.linear_num_value_heads)
        w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
        w.add_full_attention_interval(2)
        if getattr(c, "num_experts", 0):
            w.add_expert_count(c.num_experts)
            w.add_expert_used_count(c.num_experts_per_tok)
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    model.save_pretrained(path.parent / f"{family}_hf", safe_serialization=True)
    state = load_file(path.parent / f"{family}_hf" / "model.safetensors")
    experts: dict = {}
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.astype(np.float32)
        if family == "granite":
            pairs = _granite_tensors(c, name, t)
        else:
            pairs = _qwen_tensors(c, name, t, family != "qwen3_next")
        for hf_name, t in pairs:
            if ".mlp.experts." in hf_name:          # Qwen2MoeModel: one stack per projection
                bid, j, proj = hf_name.split(".")[2], int(hf_name.split(".")[5]), \
                    hf_name.split(".")[6].removesuffix("_proj")
                experts.setdefault((bid, proj), {})[j] = t
                if len(experts[(bid, proj)]) < c.num_experts:
                    continue
                stack = experts.pop((bid, proj))
                hf_name, t = f"blk.{bid}.ffn_{proj}_exps.weight", np.stack(
                    [stack[e] for e in range(c.num_experts)])
            gname = hf_name if hf_name.startswith("blk.") else names.get_name(
                hf_name, try_suffixes=(".weight", ".bias"))
            assert gname, hf_name
            if qtype is not None and t.ndim >= 2 and t.shape[-1] % 32 == 0 \
                    and "ssm_conv1d" not in gname and "norm" not in gname:
                w.add_tensor(gname, quantize(t, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gname, np.ascontiguousarray(t))
    assert not experts
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _load_gguf(path: str, family: str):
    hf, reader, _, _ = G.open_gguf(path, tokenizer=False)
    arch = registry.for_gguf_arch(ARCH[family])
    cfg = arch.config_from_hf(hf)
    return arch, cfg, arch.params_from_hf(cfg, reader, jnp.float32)


@pytest.fixture(scope="module", params=list(ARCH))
def converted(request, tmp_path_factory):
    family = request.param
    model = _model(family)
    path = tmp_path_factory.mktemp(family) / f"{family}.gguf"
    write_gguf(path, model, family)
    return family, model, str(path), str(path.parent / f"{family}_hf")


def _assert_same_config(cfg, ref):
    """Equal, floats to float32 (GGUF metadata's precision); the end-of-sequence ids are the
    tokenizer metadata's, which these files leave out."""
    for f in dataclasses.fields(ref):
        if f.name == "eos_token_ids":
            continue
        a, b = getattr(cfg, f.name), getattr(ref, f.name)
        if isinstance(b, float):
            assert a == pytest.approx(b, rel=1e-6), f.name
        else:
            assert a == b, f.name


def _assert_same(params, ref, **tol):
    flat, flat_ref = jax.tree.leaves_with_path(params), jax.tree.leaves(ref)
    assert len(flat) == len(flat_ref)
    for (where, a), b in zip(flat, flat_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=str(where), **tol)


def test_gguf_loads_the_checkpoints_parameters(converted):
    """The GGUF's config is the checkpoint's and its tensors convert back to its parameters
    (float32; -exp then log, and +1 then -1, round by an ulp or so)."""
    family, _, path, hf_dir = converted
    arch, cfg, params = _load_gguf(path, family)
    arch_hf, cfg_hf, ref = load_checkpoint(hf_dir)
    assert arch is arch_hf
    _assert_same_config(cfg, cfg_hf)
    _assert_same(params, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "granite"])
def test_gguf_q8_0_matrices(family, tmp_path):
    """Q8_0 matrices (the state parameters, norms and conv taps stay F32): every parameter
    within Q8_0's rounding (a block's largest value / 127 / 2; weights N(0, 0.15), so 6 sigma)
    of the checkpoint's."""
    from gguf import GGMLQuantizationType as T
    model = _model(family)
    path = write_gguf(tmp_path / f"{family}.gguf", model, family, T.Q8_0)
    types = G.GGUFFile(path).tensors
    assert any(qt == T.Q8_0 for qt, *_ in types.values())
    _, cfg, params = _load_gguf(path, family)
    _, cfg_hf, ref = load_checkpoint(str(tmp_path / f"{family}_hf"))
    _assert_same_config(cfg, cfg_hf)
    _assert_same(params, ref, rtol=1e-5, atol=0.15 * 6 / 127 / 2)


@pytest.mark.parametrize("family", ["qwen3_next", "granite"])
def test_gguf_greedy_equals_transformers(family, tmp_path):
    """Two prompts batched, the longer prefilled in chunks of 8: transformers' logits and
    greedy tokens."""
    model = _model(family)
    path = write_gguf(tmp_path / f"{family}.gguf", model, family)
    arch, cfg, params = _load_gguf(path, family)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, 256, n))) for n in (13, 29)]
    logits, tokens = paged_greedy(arch, cfg, params, prompts, chunk=8, new_tokens=NEW_TOKENS,
                                  page_size=8)
    for prompt, lg, tk in zip(prompts, logits, tokens):
        ref_logits, ref_tokens = hf_greedy(model, prompt, NEW_TOKENS)
        assert_logits_close(lg, ref_logits, rel=1e-3)    # the families' own tests' tolerance
        assert tk == ref_tokens
