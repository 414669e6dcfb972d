"""The plan's part for MTP drafting (`--speculative-method mtp`, maxjax/engine/mtp.py): whether
the model can draft with its MTP layers, how many drafts a step verifies, and the MTP layer's
latent pool in the memory plan. Called by maxjax/engine/plan.py only (tests/test_plan_once.py).
"""
from __future__ import annotations

from maxjax.errors import UserError

ARCHITECTURES = ("DeepseekV3ForCausalLM",)     # graphs/mtp.py's decoder layer: MLA


def check(cfg, model_cfg, mesh=None) -> None:
    """One line naming the flag where `model_cfg` cannot draft with MTP layers."""
    if cfg.speculative_method != "mtp":
        return
    name = f"--speculative-method mtp: {model_cfg.architecture}"
    if not model_cfg.num_mtp_layers:
        raise UserError(f"{name} has no MTP layers (its config.json's num_nextn_predict_layers "
                        f"is 0 or absent): use --speculative-method ngram or draft")
    if model_cfg.architecture not in ARCHITECTURES:
        raise UserError(f"{name}: MTP drafting is implemented for {', '.join(ARCHITECTURES)}")
    if mesh is not None and mesh.size > 1:
        raise UserError(f"{name} with --devices {cfg.devices}: the MTP layer runs on one device")
    k = cfg.num_speculative_tokens
    if k is not None and k > mtp_layers(cfg, model_cfg):
        raise UserError(f"--num-speculative-tokens {k}: --speculative-method mtp drafts one token "
                        f"per MTP layer the model uses ({mtp_layers(cfg, model_cfg)})")


def mtp_layers(cfg, model_cfg) -> int:
    """The MTP layers the engine runs: the first one (one draft a step), 0 without MTP."""
    return min(1, model_cfg.num_mtp_layers) if cfg.speculative_method == "mtp" else 0


def pool_config(cfg, model_cfg):
    """The model config the memory plan sizes a page of: with MTP, one more latent layer (the
    MTP layer's pool has the target's pages)."""
    n = mtp_layers(cfg, model_cfg)
    if not n:
        return model_cfg
    from maxjax.graphs.mtp import with_layers
    return with_layers(model_cfg, model_cfg.num_layers + n)
