"""--speculative-method mtp (maxjax/engine/mtp.py, graphs/mtp.py) on a tiny random DeepSeek-V3
checkpoint with one MTP layer, made here: transformers' MtpModel for the model, its layer
written where DeepSeek-V3 checkpoints keep it (model.layers.{num_hidden_layers}.: the decoder
layer's names, enorm, hnorm, eh_proj, shared_head.norm). The MTP layer's logits equal
transformers' MtpModel's; through the engine at temperature 0 the output equals the engine
without speculation and transformers' generate, with drafts accepted and counted in /metrics;
a model without MTP layers is a one-line error naming the flag."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import torch

from maxjax.engine.types import SamplingParams
from reference import assert_logits_close, scramble_grouped_moe
from test_deepseek_v3 import ENGINE, LAYERS, NEW_TOKENS, VOCAB, _config, _hf_generate, _write

pytestmark = pytest.mark.slow      # two engines' graphs and a checkpoint: ~1-2 min on 2 cores

# float32; the absorbed latent attention and the routed sum add in another order than
# transformers' (~1e-7 of the largest logit, as tests/test_deepseek_v3.py measures); a wrong
# norm, rope position or input order moves the MTP logits by ~1e-1 of it.
LOGIT_REL_TOL = 1e-3


def _train_mtp(model, mtp, prompts, steps: int = 60):
    """Adam steps of the MTP layer (the target frozen) on the target's own greedy continuations
    of `prompts`, so that its drafts there are right often enough to be accepted (random MTP
    weights almost never are; a wrong hidden state, token or position in the engine's MTP
    step still drafts wrong tokens)."""
    seqs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            seqs.append((ids, model(ids, output_hidden_states=True).hidden_states[-1]))
    params = [p for n, p in mtp.named_parameters() if n.startswith("layers.")]
    gen = torch.Generator().manual_seed(1)   # its own start, whatever else ran in this process
    with torch.no_grad():
        for p in params:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else 0.1 * torch.randn(p.shape, generator=gen))
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(steps):
        loss = 0.0
        for ids, h in seqs:
            L = ids.shape[1]
            x = mtp.forward_layer(0, h[:, :L - 2], torch.arange(1, L - 1)[None], None,
                                  input_ids=ids[:, 1:L - 1])
            loss = loss + torch.nn.functional.cross_entropy(
                mtp._project_to_logits(x)[0], ids[0, 2:])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    assert all(torch.isfinite(p).all() for p in params), "the MTP layer's training diverged"
    return mtp.eval()


def _write_mtp(model, mtp, path):
    """The MTP layer's tensors added to the checkpoint under DeepSeek-V3's names."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM
    wide = DeepseekV3ForCausalLM(_config(num_hidden_layers=LAYERS + 1))
    wide.model.layers[LAYERS] = mtp.layers[0].mtp_block
    wide.save_pretrained(os.path.join(path, "wide"), safe_serialization=True)
    pre = f"model.layers.{LAYERS}."
    extra = {k: v for k, v in load_file(os.path.join(path, "wide", "model.safetensors")).items()
             if k.startswith(pre)}
    m = mtp.layers[0]
    for name, p in (("enorm", m.enorm), ("hnorm", m.hnorm), ("eh_proj", m.eh_proj),
                    ("shared_head.norm", m.post_norm)):
        extra[f"{pre}{name}.weight"] = p.weight.detach().clone().contiguous()
    file = os.path.join(path, "model.safetensors")
    save_file({**load_file(file), **extra}, file, metadata={"format": "pt"})
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        hf = json.load(f)
    hf.pop("num_mtp_layers", None)
    hf["num_nextn_predict_layers"] = 1
    with open(cfg_file, "w") as f:
        json.dump(hf, f)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, its MtpModel, directory of the float32 checkpoint with both)."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel
    torch.manual_seed(0)
    model = scramble_grouped_moe(DeepseekV3ForCausalLM(_config(num_mtp_layers=1)).eval())
    for p in model.parameters():
        p.requires_grad_(False)
    mtp = _train_mtp(model, MtpModel(model, 1), _prompts())
    path = _write(model, tmp_path_factory.mktemp("deepseek_v3_mtp"))
    _write_mtp(model, mtp, path)
    return model, mtp, path


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(3, VOCAB, n))) for n in (5, 13, 29)]


def test_mtp_logits_match_transformers(checkpoint):
    """The MTP layer over a 13-token prefix (entries 0..11: h_i with token i+1) in one paged
    step: its logits at the last entry equal MtpModel's."""
    import jax.numpy as jnp

    from maxjax.graphs import mtp
    from maxjax.graphs.decoder import init_kv
    from maxjax.graphs.step import RowSlice, build_step_inputs
    from maxjax.models.hf import SafetensorsReader
    from paged_harness import load_checkpoint
    model, ref_mtp, path = checkpoint
    arch, cfg, params = load_checkpoint(path)
    assert cfg.num_mtp_layers == 1
    mparams = mtp.params_from_hf(cfg, SafetensorsReader(path), jnp.float32)
    prompt = _prompts()[1]
    page, pages = 8, [1, 2]
    step = build_step_inputs([RowSlice(prompt, 0, pages)], 16, 1, 2, page)
    h, _ = jax.jit(lambda p, kv, s: arch.hidden_states(cfg, p, kv, s))(
        params, init_kv(cfg, 3, page, jnp.float32), step)
    mstep = build_step_inputs([RowSlice(prompt[1:], 0, pages)], 16, 1, 2, page)
    pool = tuple(jnp.zeros(s.shape, s.dtype) for s in mtp.pool_specs(cfg, 3, page, jnp.float32))
    logits, _ = jax.jit(lambda *a: mtp.draft_logits(cfg, *a))(
        params, mparams, pool, mstep, np.arange(16, dtype=np.int32), h)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states[-1]
        _, ref, _ = ref_mtp(input_ids=ids[:, 1:], last_hidden_states=hs[:, :-1],
                            attention_mask=None, position_ids=torch.arange(1, len(prompt))[None],
                            mtp_cache=None)
    assert_logits_close(np.asarray(logits)[0], ref[0, -1].numpy(), LOGIT_REL_TOL)


def _core(path, **flags):
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    from maxjax.models.loader import load_model
    return build_core(load_model(path, "float32", progress=False),
                      EngineConfig(**{**ENGINE, **flags}))


def _generate(core):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(_prompts()):
        core.add_request(f"r{i}", prompt, greedy)
    tokens = {f"r{i}": [] for i in range(3)}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(3)]


@pytest.fixture(scope="module")
def runs(checkpoint):
    """(tokens without speculation, tokens with MTP drafts, the MTP engine)."""
    path = checkpoint[2]
    base = _generate(_core(path))
    core = _core(path, speculative_method="mtp")
    return base, _generate(core), core


def test_mtp_output_equals_no_speculation_and_transformers(checkpoint, runs):
    base, spec, core = runs
    assert spec == base
    for prompt, got in zip(_prompts(), spec):
        assert got == _hf_generate(checkpoint[0], prompt)
    stats = core.stats()
    assert stats.spec.draft_tokens > 0 and stats.spec.accepted_tokens > 0
    assert core.step_compiles == 0      # the MTP graphs compiled at warm-up


def test_acceptance_in_metrics(runs):
    from prometheus_client.parser import text_string_to_metric_families

    from maxjax.engine.async_engine import AsyncEngine
    from maxjax.server.metrics import ServerMetrics
    core = runs[2]

    class Engine:          # AsyncEngine's stats() over this core's numbers
        stats = lambda self: AsyncEngine.stats(self)          # noqa: E731
        _stats = core.stats()
    text = ServerMetrics(Engine()).render().decode()
    samples = {(s.name, s.labels.get("position")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    spec = core.stats().spec
    assert samples[("maxjax_spec_decode_num_accepted_tokens_total", None)] == \
        spec.accepted_tokens > 0
    assert samples[("maxjax_spec_decode_acceptance_rate", "0")] == \
        spec.accepted_at[0] / spec.drafted_at[0]


def test_mtp_without_mtp_layers_is_one_line_error(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    from maxjax.errors import UserError
    torch.manual_seed(0)
    path = _write(DeepseekV3ForCausalLM(_config()).eval(), tmp_path / "plain")
    with pytest.raises(UserError, match=r"^--speculative-method mtp: DeepseekV3ForCausalLM has "
                                        r"no MTP layers[^\n]*$"):
        _core(path, speculative_method="mtp")
