"""Random PEFT LoRA adapters made with `peft` itself (the reference), for the LoRA tests."""
from __future__ import annotations


def hf_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def write_peft_adapter(model_dir, out_dir, seed: int, r: int = 4, alpha: float = 8.0,
                       targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"), use_rslora: bool = False, scale: float = 0.3):
    """A PEFT adapter on the HF model in model_dir with random non-zero A and B (PEFT's B starts
    at zero, which would test nothing), saved to out_dir. Returns (out_dir, the peft model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    base = hf_model(model_dir)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                            use_rslora=use_rslora, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out_dir)
    return str(out_dir), model.eval()
