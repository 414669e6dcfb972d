"""The newer families' tiny random transformers models (MLA, group-routed MoE, the hybrids),
scrambled to be sharp where routing must be decisive: MAKERS {name: a function making one},
shared by the tests that run each family through another path (tests/test_grouped_moe_parallel.py
on a mesh, test_family_int8.py quantized, test_family_artifacts.py through AOT artifacts). Call
them after torch.manual_seed; the families' own tests check the arithmetic."""
from __future__ import annotations

from reference import scramble_grouped_moe


def deepseek_v3():
    from transformers import DeepseekV3ForCausalLM
    from test_deepseek_v3 import _config
    return DeepseekV3ForCausalLM(_config())


def glm4_moe():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    return Glm4MoeForCausalLM(Glm4MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True, num_mtp_layers=0, eos_token_id=None, max_position_embeddings=512))


def _qwen(name: str):
    from test_qwen3_next import _model, scramble
    return scramble(_model(name))


def _granite4():
    from test_granitemoehybrid import _model
    return _model(0)


MAKERS = {"deepseek_v3": lambda: scramble_grouped_moe(deepseek_v3().eval()),
          "glm4_moe": lambda: scramble_grouped_moe(glm4_moe().eval()),
          "qwen3_next": lambda: _qwen("qwen3_next"),
          "qwen3_5_moe": lambda: _qwen("qwen3_5_moe"),
          "granitemoehybrid": _granite4}
