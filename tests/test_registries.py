"""The registries: architectures found from their graphs/ modules (and --custom-architectures)
carrying their GGUF facts, and attention backends chosen from their own facts."""
from __future__ import annotations

import itertools
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGUFWriter

from maxjax import graphs
from maxjax.graphs import attention, cpu_kernels
from maxjax.models import gguf as G
from maxjax.models import registry

BUILTINS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
            "Gemma3ForCausalLM", "Olmo2ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
            "GraniteForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
            "GptOssForCausalLM", "Gemma3ForConditionalGeneration",
            "Qwen2_5_VLForConditionalGeneration", "DeepseekV3ForCausalLM",
            "Glm4MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
            "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
            "Qwen3_5MoeForConditionalGeneration", "GraniteMoeHybridForCausalLM"}


# --- architectures ----------------------------------------------------------------------------

def test_discovery_finds_every_builtin_family():
    assert {a.name for a in registry.builtin_architectures()} == BUILTINS
    assert BUILTINS <= set(registry.architectures())
    assert {a: registry.for_gguf_arch(a).name for a in
            ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "phi3", "granite")} == {
        "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
        "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM"}


def test_a_new_family_is_its_file_alone(tmp_path, monkeypatch):
    (tmp_path / "toy_family.py").write_text(textwrap.dedent("""
        from maxjax.graphs.arch import Architecture, base_config
        ARCHITECTURE = Architecture("ToyForCausalLM", base_config)
    """))
    monkeypatch.setattr(graphs, "__path__", [*graphs.__path__, str(tmp_path)])
    try:
        assert "ToyForCausalLM" in {a.name for a in registry.builtin_architectures()}
    finally:
        sys.modules.pop("maxjax.graphs.toy_family", None)


def test_gguf_layer_names_per_family():
    shared = G.LAYER_NAMES
    names = {a: G.layer_names(registry.for_gguf_arch(a))
             for a in ("llama", "gemma2", "olmo2", "phi3")}
    assert names["llama"] == shared
    assert names["gemma2"]["pre_feedforward_layernorm.weight"] == "ffn_norm.weight"
    assert names["gemma2"]["post_attention_layernorm.weight"] == "post_attention_norm.weight"
    assert "input_layernorm.weight" not in names["olmo2"]
    assert names["phi3"] == {"input_layernorm.weight": "attn_norm.weight",
                             "self_attn.qkv_proj.weight": "attn_qkv.weight",
                             "self_attn.o_proj.weight": "attn_output.weight",
                             "post_attention_layernorm.weight": "ffn_norm.weight",
                             "mlp.gate_up_proj.weight": "ffn_up.weight",
                             "mlp.down_proj.weight": "ffn_down.weight"}


def test_custom_architecture_brings_its_gguf_facts(tmp_path, monkeypatch):
    """A --custom-architectures family reads its own GGUF: metadata rule and tensor names."""
    monkeypatch.setattr(registry, "_registry", dict(registry.architectures()))
    (tmp_path / "toy_archs.py").write_text(textwrap.dedent("""
        from maxjax.graphs.arch import Architecture, base_config

        def gguf_config(hf, get, tensors):
            hf["toy_scale"] = float(get("toy_scale", 1.0))

        ARCHITECTURES = [Architecture("ToyGGUFForCausalLM", base_config, gguf_archs=("toy",),
                                      gguf_config=gguf_config,
                                      gguf_layer_names={"mlp.up_proj.weight": "ffn_in.weight"})]
    """))
    registry.register_custom(str(tmp_path / "toy_archs.py"))
    w = GGUFWriter(str(tmp_path / "toy.gguf"), "toy")
    for key, v in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 16),
                   ("attention.head_count", 2), ("vocab_size", 4)):
        w.add_uint32(f"toy.{key}", v)
    w.add_float32("toy.toy_scale", 2.5)
    w.add_tensor("blk.0.ffn_in.weight", np.ones((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = G.GGUFFile(str(tmp_path / "toy.gguf"))
    hf = G.hf_config(gf, "toy", "ToyGGUFForCausalLM")
    assert hf["toy_scale"] == 2.5 and hf["architectures"] == ["ToyGGUFForCausalLM"]
    reader = G.GGUFTensorReader(gf, "toy", hf)
    assert reader.names() == ["model.layers.0.mlp.up_proj.weight"]
    assert reader("model.layers.0.mlp.up_proj.weight").shape == (16, 8)


# --- attention backends -----------------------------------------------------------------------

def old_plan_layout_choice(platform, head_dim, page_size, kernels, kernels_build):
    """plan_layout's choice before backends carried their facts (maxjax/engine/core.py), as the
    reference: the Pallas kernel on CUDA (a page size it refuses is an error; a head size it
    refuses runs the query blocks), the CPU kernel with --use-experimental-kernels on the CPU."""
    pow2 = lambda n: n >= 16 and not n & (n - 1)   # noqa: E731
    attention = "pallas_paged" if platform in ("cuda", "gpu") else "query_blocks"
    if attention == "pallas_paged":
        if not pow2(page_size):
            raise ValueError("power of two")
        if not pow2(head_dim):
            attention = "query_blocks"
    elif kernels and platform == "cpu":
        if kernels_build and head_dim in (16, 32, 64, 96, 128, 256):
            attention = "cpu_paged_kernel"
    return attention


def test_backend_choice_matches_the_old_plan_layout(monkeypatch):
    cases = itertools.product(("cpu", "cuda", "gpu", "tpu", "rocm"),
                              (8, 16, 24, 32, 64, 80, 96, 128, 256), (1, 8, 16, 24, 32, 128),
                              (False, True), (False, True))
    for platform, head_dim, page, kernels, builds in cases:
        monkeypatch.setattr(cpu_kernels, "unavailable", lambda isa=None: None if builds else "no")
        case = (platform, head_dim, page, kernels, builds)
        try:
            want = old_plan_layout_choice(platform, head_dim, page, kernels, builds)
        except ValueError:
            with pytest.raises(ValueError, match="power of two"):
                attention.choose_backend(platform, head_dim, page, kernels)
            continue
        assert attention.choose_backend(platform, head_dim, page, kernels).name == want, case


def test_backend_for_platform():
    assert attention.backend_for("cuda").name == attention.backend_for("gpu").name == "pallas_paged"
    assert attention.backend_for("cpu") is attention.QUERY_BLOCKS
    assert attention.backend_for("tpu") is attention.QUERY_BLOCKS


def test_every_backend_lists_its_custom_calls():
    from maxjax.aot.graphs import EXPORT_CHECKS
    calls = {name: attention.backend_named(name).custom_calls for name in attention.REGISTRY}
    assert calls["query_blocks"] == ()
    assert calls["pallas_paged"] == ("__gpu$xla.gpu.triton",)
    assert set(calls["cpu_paged_kernel"]) == {f"maxjax_{k}_{isa}" for isa in cpu_kernels.ISAS
                                             for k in ("paged_attention", "write_kv", "zero_pool")}
    allowed = {c.is_custom_call() for c in EXPORT_CHECKS}
    assert set(attention.custom_calls()) <= allowed
    for name in attention.REGISTRY:
        assert attention.backend_named(name).name == name


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention.backend_named("nope")
