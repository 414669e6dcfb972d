"""MTP drafting on the tiny random DeepSeek-V3 of tests/test_mtp.py (its MTP layer trained on the
three prompts it generates for: acceptance is not representative): out tok/s of three greedy
requests x 32 tokens, without speculation and with --speculative-method mtp, same run.
Run: .venv/bin/python tools/bench_mtp.py"""
import os, sys, time, torch, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import test_mtp as T
from transformers import DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel
from reference import scramble_grouped_moe
torch.manual_seed(0)
model = scramble_grouped_moe(DeepseekV3ForCausalLM(T._config(num_mtp_layers=1)).eval())
for p in model.parameters(): p.requires_grad_(False)
mtp = T._train_mtp(model, MtpModel(model, 1), T._prompts())
d = tempfile.mkdtemp(); path = T._write(model, d); T._write_mtp(model, mtp, path)
for flags in ({}, {"speculative_method": "mtp"}):
    core = T._core(path, **flags)
    T._generate(core)   # warm
    t = time.perf_counter(); T._generate(core); dt = time.perf_counter() - t
    s = core.stats().spec
    print(flags, f"{3*T.NEW_TOKENS/dt:.1f} tok/s", s.draft_tokens, s.accepted_tokens)
