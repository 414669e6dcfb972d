"""Speculative decoding for hybrid models (issue 58 item 1: the state rolled back to the last
accepted draft), through the real engine: each running request holds k speculative state slots
beside its own (maxjax/engine/state_plan.py, state_slots.py), a verify row keeps its state after
each token there (graphs/recurrent.py `state_keep`), and the next row restores the one after its
last accepted draft (graphs/snapshots.py).

Partial acceptance is forced by `Oracle`, a proposer that drafts the reference continuation
with one draft a step made wrong, at a position that cycles through 0..k (so every count of
accepted drafts occurs); with the rollback switched off the same run diverges, so the equality
tests can fail. The toy hybrid (tests/toy_hybrid.py) also runs with a draft model (a tiny
Llama of its vocabulary) and n-gram lookup, and Qwen3-Next with the oracle and n-gram lookup
against transformers' generate: greedy tokens equal, batched, and after a preemption; no state
slot leaks."""
from __future__ import annotations

import os

import numpy as np
import pytest

from maxjax.engine.config import EngineConfig
from maxjax.engine.state_slots import StateSlots
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError

pytestmark = pytest.mark.slow

TOY = os.path.join(os.path.dirname(__file__), "toy_hybrid.py")
K, NEW_TOKENS = 3, 24
ENGINE = dict(max_batch_size=4, max_batch_input_tokens=16, max_length=96, num_kv_pages=48,
              kv_cache_page_size=8, num_speculative_tokens=K)


class Oracle:
    """Drafts `reference[request id]` from the request's next token, the draft at position
    (proposals to the request so far % (k + 1)) changed (none at k): a verify row keeps that
    many drafts."""

    def __init__(self, reference: dict, vocab: int):
        self.reference, self.vocab = reference, vocab
        self.calls: dict[str, int] = {}

    def propose(self, requests, k: int):
        out = []
        for r in requests:
            n = r.num_output_tokens
            drafts = list(self.reference[r.request_id][n:n + k])
            wrong = self.calls[r.request_id] = self.calls.get(r.request_id, -1) + 1
            wrong %= k + 1
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % self.vocab
            out.append(drafts)
        return out

    def warmup(self):
        pass

    def reset(self):
        pass

    def observe(self, rows, results):
        pass


def _every_draft(core):
    """The speculator verifies every draft proposed (not only those its cost model pays for)."""
    core.speculator._best_count = lambda n, rows, prefill, worth, max_d: max_d


def _greedy(n=NEW_TOKENS):
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _run(core, prompts: dict, sampling, preempt_after: int | None = None) -> dict:
    """{id: tokens} of `prompts` run together to their end; every running request preempted
    once the first has `preempt_after` tokens (asserted to happen)."""
    for rid, p in prompts.items():
        core.add_request(rid, p, sampling)
    tokens = {rid: [] for rid in prompts}
    first, preempted = next(iter(prompts)), False
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if preempt_after is not None and not preempted and len(tokens[first]) >= preempt_after:
            core.scheduler.preempt_running()
            preempted = True
    assert preempted or preempt_after is None
    return tokens


def _no_leak(core):
    slots = core.state_slots
    assert slots.num_free == slots.num_slots - 1 and slots.num_pending == 0


# ---- the bookkeeping alone ----------------------------------------------------------------------
class _Req:
    def __init__(self, rid):
        self.request_id, self.state_slot = rid, 0


def test_state_slots_hand_out_speculative_slots_and_roll_back():
    slots = StateSlots(1 + 2 * (1 + K), per_request=1 + K)
    a, b = _Req("a"), _Req("b")
    slots.acquire(a)
    slots.acquire(b)
    assert (a.state_slot, slots.spec_slots(a)) == (1, [2, 3, 4])
    assert (b.state_slot, slots.spec_slots(b)) == (5, [6, 7, 8]) and slots.num_free == 0
    # a verify row of 3 drafts keeps the state after its first three tokens, not its last
    assert slots.verify_slots(a, 3) == (0, [2, 3, 4, 0])
    slots.accepted(a, 3, 1)                    # d1 stood, d2 did not: the state after d1
    assert slots.num_pending == 1
    assert slots.verify_slots(a, 2) == (3, [2, 3, 0])    # restored once, then its own slot
    slots.accepted(a, 2, 2)                    # all stood: its own slot holds the state
    assert slots.verify_slots(a, 0) == (0, None)
    slots.accepted(b, 2, 0)                    # none stood: the state after its last token
    assert slots.verify_slots(b, 1) == (6, [6, 0])
    slots.accepted(b, 1, 0)
    slots.release(b)                           # a pending rollback goes with its slots
    assert b.state_slot == 0 and slots.num_free == 4 and slots.num_pending == 0
    slots.acquire(b)
    assert slots.verify_slots(b, 0) == (0, None)
    slots.release(a)
    slots.release(b)
    assert slots.num_free == 8


# ---- the toy hybrid -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from toy_hybrid import register, write_toy_hybrid
    register()
    return write_toy_hybrid(tmp_path_factory.mktemp("toy_hybrid"))


@pytest.fixture(scope="module")
def model(checkpoint):
    from maxjax.models.loader import load_model
    return load_model(checkpoint, "float32", progress=False)


def _prompts():
    rng = np.random.default_rng(1)
    return {f"r{i}": list(map(int, rng.integers(3, 256, n))) for i, n in enumerate((5, 13, 29))}


@pytest.fixture(scope="module")
def expected(checkpoint):
    from paged_harness import load_checkpoint, paged_greedy
    arch, cfg, params = load_checkpoint(checkpoint)
    prompts = _prompts()
    _, tokens = paged_greedy(arch, cfg, params, list(prompts.values()), chunk=7,
                             new_tokens=NEW_TOKENS, page_size=8)
    return dict(zip(prompts, tokens))


@pytest.fixture(scope="module")
def core(model):
    """The toy hybrid speculating with n-gram lookup (its proposer swapped for an Oracle)."""
    from maxjax.engine.build import build_core
    core = build_core(model, EngineConfig(**ENGINE, speculative_method="ngram"))
    _every_draft(core)
    return core


def test_the_plan_holds_k_speculative_slots_a_request(core, model):
    from maxjax.engine.plan import plan_engine
    lay = core.layout
    # 4 requests x (1 + 3 speculative) + scratch, then 4 prefix-cache snapshots
    assert (lay.state_slots, lay.state_spec, lay.state_snapshots) == (21, 12, 4)
    assert core.state_slots.num_slots == 17 and core.state_slots.per_request == 4
    assert (core.snapshots.first, core.snapshots.count) == (17, 4)
    assert "21 slots (4 requests + 12 speculative" in lay.state_report
    plain = plan_engine(EngineConfig(**{**ENGINE, "num_speculative_tokens": None}), model)
    assert (plain.layout.state_slots, plain.layout.state_spec) == (9, 0)
    with pytest.raises(UserError, match=r"^--speculative-method mtp: ToyHybridForCausalLM keeps "
                                        r"a fixed-size state .* use --speculative-method draft"):
        plan_engine(EngineConfig(**ENGINE, speculative_method="mtp"), model)


def test_partial_acceptance_rolls_the_state_back(core, expected):
    spec = core.speculator
    spec.proposer = Oracle(expected, 256)
    before = (spec.num_draft_tokens, spec.num_accepted_tokens)
    tokens = _run(core, _prompts(), _greedy())
    assert tokens == expected
    drafts, accepted = (spec.num_draft_tokens - before[0], spec.num_accepted_tokens - before[1])
    assert 0 < accepted < drafts
    # every count of kept drafts happened: none, some, all three
    assert spec.accepted_at[0] < spec.drafted_at[0] and spec.accepted_at[K - 1] > 0
    _no_leak(core)


def test_after_a_preemption(core, expected):
    core.speculator.proposer = Oracle(expected, 256)
    assert _run(core, _prompts(), _greedy(), preempt_after=6) == expected
    _no_leak(core)


def test_without_the_rollback_the_tokens_diverge(core, expected, monkeypatch):
    """The control: the same run keeping the state past rejected drafts gives other tokens."""
    core.speculator.proposer = Oracle(expected, 256)
    monkeypatch.setattr(StateSlots, "accepted", lambda self, req, d, j: None)
    assert _run(core, _prompts(), _greedy()) != expected
    _no_leak(core)


def test_ngram_lookup(core, expected):
    from maxjax.engine.speculative import NgramProposer
    core.speculator.proposer = NgramProposer(1, 3)
    assert _run(core, _prompts(), _greedy()) == expected
    _no_leak(core)


def test_a_draft_model(model, checkpoint, expected, tmp_path):
    """A tiny Llama of the toy's vocabulary drafts: the same tokens; a hybrid draft is
    refused in one line."""
    from maxjax.engine.build import build_core
    from tiny_llama import write_tiny_llama
    path = write_tiny_llama(tmp_path / "draft", tokenizer=model.tokenizer, vocab_size=256)
    core = build_core(model, EngineConfig(**ENGINE, speculative_method="draft",
                                          draft_model_path=path))
    _every_draft(core)
    assert _run(core, _prompts(), _greedy()) == expected
    assert core.speculator.num_draft_tokens > 0
    _no_leak(core)
    assert not core.speculator.proposer.live and core.speculator.proposer.bm.num_used_pages == 0
    with pytest.raises(UserError, match=r"^--draft-model-path .*: ToyHybridForCausalLM keeps a "
                                        r"fixed-size state per request") as e:
        build_core(model, EngineConfig(**ENGINE, speculative_method="draft",
                                       draft_model_path=checkpoint))
    assert "\n" not in str(e.value)


# ---- Qwen3-Next against transformers ------------------------------------------------------------
QWEN_ENGINE = {**ENGINE, "max_batch_input_tokens": 32}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(transformers model, our model) of a tiny random Qwen3-Next (tests/test_qwen3_next.py)."""
    import torch
    from maxjax.models.loader import load_model
    from test_qwen3_next import VOCAB, _model, scramble
    from tiny_llama import write_word_tokenizer
    torch.manual_seed(0)
    hf = scramble(_model("qwen3_next"))
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path, safe_serialization=True)
    write_word_tokenizer(path, VOCAB)
    return hf, load_model(str(path), "float32", progress=False)


def _qwen_prompts():
    rng = np.random.default_rng(2)
    return {f"q{i}": list(map(int, rng.integers(3, 256, n))) for i, n in enumerate((7, 30, 19))}


@pytest.fixture(scope="module")
def qwen_expected(qwen):
    from reference import hf_generate
    return {rid: hf_generate(qwen[0], p, NEW_TOKENS) for rid, p in _qwen_prompts().items()}


@pytest.fixture(scope="module")
def qwen_core(qwen):
    from maxjax.engine.build import build_core
    core = build_core(qwen[1], EngineConfig(**QWEN_ENGINE, speculative_method="ngram"))
    _every_draft(core)
    return core


def _verify_buckets(core) -> list:
    """Records, per step, whether a row kept states in a bucket the DeltaNet runs chunked."""
    from maxjax.graphs.gated_deltanet import CHUNK
    from maxjax.graphs.recurrent import num_chunks
    seen, launch = [], core.runner.launch

    def spy(rows, feed=None):
        out = launch(rows, feed)
        b = out.bucket
        keeps = any(r.slice.state_keep is not None for r in rows)
        seen.append(keeps and 4 * num_chunks(b.num_tokens, b.num_rows, CHUNK) <= b.num_tokens)
        return out
    core.runner.launch = spy
    return seen


def test_qwen3_next_partial_acceptance_equals_transformers(qwen_core, qwen_expected):
    spec = qwen_core.speculator
    spec.proposer = Oracle(qwen_expected, 256)
    chunked_verify = _verify_buckets(qwen_core)
    try:
        tokens = _run(qwen_core, _qwen_prompts(), _greedy())
    finally:
        del qwen_core.runner.launch
    assert tokens == qwen_expected
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.accepted_at[0] < spec.drafted_at[0] and spec.accepted_at[K - 1] > 0
    # verify rows beside a prefill chunk in a chunked bucket took the token scan there
    assert any(chunked_verify)
    _no_leak(qwen_core)


def test_qwen3_next_after_a_preemption(qwen_core, qwen_expected):
    qwen_core.speculator.proposer = Oracle(qwen_expected, 256)
    assert _run(qwen_core, _qwen_prompts(), _greedy(), preempt_after=5) == qwen_expected
    _no_leak(qwen_core)


def test_qwen3_next_ngram_lookup(qwen_core, qwen_expected):
    from maxjax.engine.speculative import NgramProposer
    qwen_core.speculator.proposer = NgramProposer(1, 3)
    assert _run(qwen_core, _qwen_prompts(), _greedy()) == qwen_expected
    _no_leak(qwen_core)
