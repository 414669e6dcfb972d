"""The reference nobody here wrote: transformers' PyTorch models, float32 on the CPU."""
from __future__ import annotations

import numpy as np


def hf_greedy(hf_model, prompt, new_tokens: int):
    """transformers' greedy continuation (EOS not special), and its float32 logits after the
    prompt and after each generated token but the last: the places paged_greedy reports."""
    import torch
    logits, tokens = [], []
    with torch.no_grad():
        # logits_to_keep=1: the prompt's other logits would cost prompt x vocab (262k for Gemma3).
        out = hf_model(torch.tensor([list(prompt)]), use_cache=True, logits_to_keep=1)
        for _ in range(new_tokens):
            row = out.logits[0, -1].float().numpy()
            logits.append(row)
            tokens.append(int(np.argmax(row)))
            if len(tokens) == new_tokens:
                break
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                           use_cache=True)
    return np.stack(logits), tokens


def hf_generate(hf_model, prompt, new_tokens: int) -> list[int]:
    """transformers' generate: `new_tokens` greedy tokens after `prompt` (EOS not special)."""
    import torch
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([list(prompt)]), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return ref[0, len(prompt):].tolist()


def assert_logits_close(ours, ref, rel=1e-3):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = float(np.max(np.abs(ours - ref)))
    tol = rel * float(np.max(np.abs(ref)))
    assert err <= tol, f"max |dlogit| {err:.3g} > {tol:.3g}"


def scramble_grouped_moe(model):
    """Initialization's std 0.02 leaves logits near 0 and routing by the bias-free scores:
    make every parameter, the correction bias included, count."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
    return model
