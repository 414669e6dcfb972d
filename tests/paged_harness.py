"""Drive a graph through the step contract the way the engine does, without the engine:
several sequences share each step, prompts are prefilled in chunks, then decoded greedily."""
from __future__ import annotations

from functools import partial

import jax
import numpy as np

from maxjax.graphs.decoder import init_kv
from maxjax.graphs.step import RowSlice, build_step_inputs


def load_checkpoint(path, int8: bool = False):
    """(architecture, config, params) of an HF checkpoint directory, float32 or int8 (as
    --quantization-encoding int8 converts it)."""
    import jax.numpy as jnp

    from maxjax.models import quantize, registry
    from maxjax.models.hf import SafetensorsReader, read_config
    hf = read_config(path)
    arch = registry.get_architecture(hf["architectures"][0])
    cfg = arch.config_from_hf(hf)
    reader = SafetensorsReader(path)
    extra = {"quantizer": quantize.Quantizer("int8", reader)} if int8 else {}
    return arch, cfg, arch.params_from_hf(cfg, reader, jnp.float32, **extra)


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_greedy(arch, cfg, params, prompts, chunk: int, new_tokens: int, page_size: int = 16,
                 dtype=np.float32, lora_slots=None):
    """Returns (logits, tokens): per prompt, the float32 logits after its last prompt token and
    after each generated token but the last ([new_tokens, vocab]), and the greedy tokens.
    `lora_slots`: per prompt, its adapter slot in params["lora"] (graphs/lora.py)."""
    lengths = [len(p) + new_tokens for p in prompts]
    pages_per_seq = [-(-n // page_size) for n in lengths]
    max_pages = max(pages_per_seq)
    tables, nxt = [], 1
    for n in pages_per_seq:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    hybrid = any(cfg.state_layers)       # request-state slot i + 1 for prompt i (graphs/state.py)
    kv = init_kv(cfg, nxt, page_size, dtype, state_slots=len(prompts) + 1 if hybrid else 0)
    step_fn = jax.jit(partial(arch.forward, cfg), donate_argnums=(1,))
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)            # tokens whose K/V are in the cache
    logits_out = [[] for _ in prompts]
    while any(len(logits_out[i]) < new_tokens for i in range(len(prompts))):
        rows, who = [], []
        for i, seq in enumerate(seqs):
            if len(logits_out[i]) >= new_tokens:
                continue
            take = min(chunk, len(seq) - done[i])
            rows.append(RowSlice(seq[done[i]:done[i] + take], done[i], tables[i],
                                 lora_slot=lora_slots[i] if lora_slots else 0,
                                 state_slot=i + 1 if hybrid else 0))
            who.append((i, done[i] + take == len(seq)))
            done[i] += take
        T = _bucket(sum(len(r.token_ids) for r in rows))
        step = build_step_inputs(rows, T, _bucket(len(rows)), max_pages, page_size,
                                 lora=lora_slots is not None, state=hybrid)
        logits, kv = step_fn(params, kv, step)
        logits = np.asarray(logits)
        for r, (i, at_end) in enumerate(who):
            if at_end:
                logits_out[i].append(logits[r])
                seqs[i].append(int(np.argmax(logits[r])))
    tokens = [s[len(p):] for s, p in zip(seqs, prompts)]
    return [np.stack(x) for x in logits_out], tokens
