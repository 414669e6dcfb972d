"""max serve's speculative-decoding flags: each one changes what the speculator does (the mock
model with an oracle proposer, the speculator built from an EngineConfig as the engine builds
it), the values maxjax cannot serve are one-line start-up errors, and --draft-devices places the
draft model (tiny random Llamas on the forced host devices of conftest.py)."""
from types import SimpleNamespace

import pytest

from maxjax.engine import devices, spec_flags, speculative
from maxjax.engine.block_manager import BlockManager
from maxjax.engine.buckets import bucket_set, pick_bucket
from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from mock_model import MockModel, reference_generate
from pool_check import check_pool

VOCAB, PAGE, K, BUDGET, ROWS = 1000, 4, 3, 16, 4


class Oracle:
    """Proposes what the mock model will generate; `wrong`: every draft off by one."""
    def __init__(self, wrong=False):
        self.ref, self.wrong = {}, wrong

    def propose(self, requests, k):
        out = []
        for r in requests:
            n, ref = self.ref[r.request_id]
            drafts = list(ref[r.num_tokens - n:r.num_tokens - n + k])
            out.append([(d + 1) % VOCAB for d in drafts] if self.wrong else drafts)
        return out

    def observe(self, rows, results):
        pass


class Slot:            # as runner.Sample: what verify() rewrites
    def __init__(self, token_id):
        self.token_id = token_id


class Result:          # as runner.RowResult
    def __init__(self, tokens):
        self.samples = [Slot(t) for t in (tokens if isinstance(tokens, list) else [tokens])]

    @property
    def token_ids(self):
        return [s.token_id for s in self.samples]


def speculator(**flags):
    """The engine's Speculator for ngram with `flags`, its proposer swapped for an Oracle."""
    cfg = EngineConfig(max_batch_size=ROWS, max_batch_input_tokens=BUDGET,
                       kv_cache_page_size=PAGE, speculative_method="ngram",
                       num_speculative_tokens=K, **flags)
    spec = speculative.build(cfg, SimpleNamespace(buckets=bucket_set(BUDGET, ROWS, K + 1)),
                             k=spec_flags.draft_tokens(cfg))
    spec.proposer = Oracle()
    return cfg, spec


def run(spec, cfg, arrivals, params=None, exact=True):
    """Generate with the mock model; `arrivals`: {step: {request id: prompt}}. Returns the
    requests and, per step, (decoding rows, prefill rows, drafts of each decoding row)."""
    bm = BlockManager(64, PAGE, True)
    sched = Scheduler(cfg, bm, 256, (), max_draft_tokens=spec.k)
    model = MockModel(PAGE, VOCAB)
    reqs, steps, step = {}, [], 0
    params = params or SamplingParams(max_new_tokens=24)
    while step == 0 or sched.has_unfinished() or any(s > step for s in arrivals):
        for rid, p in arrivals.get(step, {}).items():
            reqs[rid] = Request(rid, p, params)
            spec.proposer.ref[rid] = (len(p), reference_generate(p, 200, VOCAB))
            sched.add(reqs[rid])
        step += 1
        spec.propose(sched)
        plan = sched.schedule()
        if plan is None:
            continue
        results = [Result(t) for t in model.run(plan.rows)]
        spec.verify(plan.rows, results)
        n = sum(len(r.token_ids) for r in plan.rows)
        bucket = pick_bucket(spec.buckets, n, len(plan.rows), sum(r.num_samples for r in plan.rows))
        spec.observe(plan.rows, results, bucket, 0.01)
        decode = [len(r.draft_token_ids) for r in plan.rows if r.sample and r.start_pos ==
                  r.request.num_tokens - 1]
        steps.append((len(decode), len(plan.rows) - len(decode), decode))
        sched.update(plan, [r.token_ids for r in results])
        check_pool(bm, [r for r in reqs.values() if not r.is_finished])
    if exact:
        for rid, r in reqs.items():
            assert r.output_token_ids == reference_generate(r.prompt_token_ids, 24, VOCAB)
    assert bm.num_used_pages == 0
    return reqs, steps


TWO = {0: {"a": list(range(30, 41)), "b": list(range(50, 55))}}
# a request arriving every few steps: steps that prefill while others decode
STREAM = {3 * i: {f"r{i}": list(range(10 * i + 1, 10 * i + 7))} for i in range(6)}


# ---- --num-speculative-tokens-per-batch-size --------------------------------------------------
def test_per_batch_size_schedule_caps_drafts_per_row():
    schedule = ('[{"batch_start": 1, "batch_end": 1, "num_tokens": 3},'
                ' {"batch_start": 2, "batch_end": 8, "num_tokens": 1}]')
    cfg, spec = speculator(num_speculative_tokens_per_batch_size=schedule)
    _, steps = run(spec, cfg, TWO)
    assert max(max(d) for n, p, d in steps if n == 2) == 1
    assert max(max(d) for n, p, d in steps if n == 1) == 3
    cfg, spec = speculator()                        # unset: every drafted token
    _, steps = run(spec, cfg, TWO)
    assert max(max(d) for n, p, d in steps if n == 2) > 1


def test_per_batch_size_schedule_of_zero_turns_drafts_off():
    cfg, spec = speculator(num_speculative_tokens_per_batch_size=(
        '[{"batch_start": 1, "batch_end": 4, "num_tokens": 0}]'))
    _, steps = run(spec, cfg, TWO)
    assert spec.num_draft_tokens == 0 and spec.cap(2, False) == 0 and spec.cap(5, False) == K


# ---- --enable-spec-decode-mixed-batches, --num-speculative-tokens-mixed-batch -------------------
def mixed_drafts(steps) -> list[int]:
    return [x for n, p, d in steps if p for x in d]


def test_no_mixed_batches_decode_rows_advance_draft_less():
    cfg, spec = speculator(enable_spec_decode_mixed_batches=False)
    _, steps = run(spec, cfg, STREAM)
    assert any(p and n for n, p, d in steps)        # there were mixed steps
    assert sum(mixed_drafts(steps)) == 0
    assert spec.num_draft_tokens > 0                # and drafts in decode-only steps


def test_mixed_batches_on_by_default_verify_drafts_in_prefill_steps():
    cfg, spec = speculator()
    assert cfg.enable_spec_decode_mixed_batches is True
    _, steps = run(spec, cfg, STREAM)
    assert max(mixed_drafts(steps)) == K


def test_mixed_batch_token_count():
    cfg, spec = speculator(enable_spec_decode_mixed_batches=True,
                           num_speculative_tokens_mixed_batch=1)
    _, steps = run(spec, cfg, STREAM)
    assert max(mixed_drafts(steps)) == 1
    assert max(x for n, p, d in steps if not p for x in d) == K


# ---- acceptance ---------------------------------------------------------------------------------
def test_synthetic_acceptance_rate_bypasses_the_comparison():
    cfg, spec = speculator(synthetic_acceptance_rate=1.0)
    spec.proposer.wrong = True                     # every draft wrong: all kept anyway
    run(spec, cfg, TWO, exact=False)
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    cfg, spec = speculator(synthetic_acceptance_rate=0.0)
    run(spec, cfg, TWO, exact=False)               # every draft right: none kept
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == 0
    cfg, spec = speculator()                       # unset: the real comparison
    spec.proposer.wrong = True
    run(spec, cfg, TWO)
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == 0


def test_synthetic_acceptance_rate_is_calibrated_over_the_positions():
    a = spec_flags.calibrated_rate(0.5, K)
    assert abs(sum(a ** j for j in range(1, K + 1)) / K - 0.5) < 1e-9
    cfg, spec = speculator(synthetic_acceptance_rate=0.5)
    run(spec, cfg, {0: {f"p{i}": list(range(7 * i + 1, 7 * i + 6)) for i in range(4)}},
        params=SamplingParams(max_new_tokens=80, ignore_eos=True), exact=False)
    first = spec.accepted_at[0] / spec.drafted_at[0]
    assert spec.drafted_at[0] > 60 and abs(first - a) < 0.15


@pytest.mark.parametrize("flags,greedy_only", [
    (dict(), False), (dict(use_greedy_acceptance=True), True),
    (dict(rejection_sampling_strategy="greedy"), True),
    (dict(rejection_sampling_strategy="residual"), False)])
def test_greedy_acceptance_verifies_greedy_requests_only(flags, greedy_only):
    sampled = SamplingParams(max_new_tokens=24, temperature=0.7)
    cfg, spec = speculator(**flags)
    run(spec, cfg, TWO, params=sampled)
    assert (spec.num_draft_tokens == 0) == greedy_only
    cfg, spec = speculator(**flags)
    run(spec, cfg, TWO, params=SamplingParams(max_new_tokens=24, temperature=0.0))
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0


# ---- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("options,message", [
    *[(dict(speculative_method=m), f"--speculative-method {m}: not supported here; supported: "
       "ngram, draft, mtp") for m in ("eagle", "dflash", "dflash2")],
    (dict(draft_proposal="sampled"), "--draft-proposal sampled: .*supported: argmax"),
    (dict(rejection_sampling_strategy="typical-acceptance"),
     "--rejection-sampling-strategy typical-acceptance: not implemented; supported: residual"),
    (dict(rejection_sampling_strategy="logit-comparison"), "supported: residual .*, greedy"),
    (dict(rejection_sampling_strategy="residual", use_greedy_acceptance=True), "contradicts"),
    (dict(use_relaxed_acceptance_for_thinking=True), "--use-relaxed-acceptance-for-thinking: "),
    (dict(relaxed_delta=0.1), "--relaxed-delta needs --use-relaxed-acceptance-for-thinking"),
    (dict(relaxed_topk=3), "--relaxed-topk needs --use-relaxed-acceptance-for-thinking"),
    (dict(synthetic_acceptance_rate=1.5), "expected 0.0 to 1.0"),
    (dict(synthetic_acceptance_rate=0.5, use_greedy_acceptance=True), "incompatible"),
    (dict(num_speculative_tokens_mixed_batch=8), "mixed-batch 8: expected 0 to 7"),
    (dict(num_speculative_tokens_per_batch_size="[{"), "not JSON"),
    (dict(num_speculative_tokens_per_batch_size='[{"batch_start": 1}]'), "expected a JSON list"),
    (dict(num_speculative_tokens_per_batch_size='{"batch_start": 1}'), "expected a JSON list"),
    (dict(num_speculative_tokens_per_batch_size=(
        '[{"batch_start": 0, "batch_end": 2, "num_tokens": 1}]')), "1 <= batch_start"),
    (dict(num_speculative_tokens_per_batch_size=(
        '[{"batch_start": 3, "batch_end": 2, "num_tokens": 1}]')), "1 <= batch_start"),
    (dict(num_speculative_tokens_per_batch_size=(
        '[{"batch_start": 1, "batch_end": 2, "num_tokens": 9}]')), "num_tokens 9: expected 0 to 7"),
    (dict(num_speculative_tokens_per_batch_size=(
        '[{"batch_start": 1, "batch_end": 4, "num_tokens": 1},'
        ' {"batch_start": 4, "batch_end": 8, "num_tokens": 2}]')), "1-4 and 4-8 overlap"),
    (dict(draft_devices="cpu"), "--draft-devices goes with --speculative-method draft"),
    (dict(speculative_method="draft", draft_model_path="x", draft_devices="cpu:0,2"),
     "--draft-devices 'cpu:0,2': cpu:N takes one count"),
    (dict(draft_quantization_encoding="float32"), "--draft-quantization-encoding goes with"),
])
def test_refused_values_are_one_line_errors(options, message):
    cfg = EngineConfig(**{"speculative_method": "ngram", **options})
    with pytest.raises(UserError, match=message) as e:
        spec_flags.draft_tokens(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name,value", [
    ("num_speculative_tokens", 3), ("draft_model_path", "x"), ("draft_devices", "cpu"),
    ("draft_quantization_encoding", "float32"), ("use_greedy_acceptance", True),
    ("prompt_lookup_min", 3), ("draft_proposal", "sampled"),
    ("rejection_sampling_strategy", "greedy"),
    ("num_speculative_tokens_per_batch_size", "[]"), ("num_speculative_tokens_mixed_batch", 1),
    ("enable_spec_decode_mixed_batches", False), ("use_relaxed_acceptance_for_thinking", True),
    ("relaxed_delta", 0.1), ("relaxed_topk", 2), ("synthetic_acceptance_rate", 0.5)])
def test_speculative_flags_need_a_method(name, value):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(UserError, match=f"^{flag} configures speculative decoding: it needs "
                                        f"--speculative-method$"):
        spec_flags.draft_tokens(EngineConfig(**{name: value}))


def test_flags_are_checked_before_the_weights_load(tmp_path):
    from maxjax.engine.build import build_core
    with pytest.raises(UserError, match="--speculative-method eagle"):
        build_core(str(tmp_path / "no-such-model"), EngineConfig(speculative_method="eagle"))


def test_cli_passes_reference_methods_to_the_one_line_error():
    from maxjax.cli.main import build_parser
    args = build_parser().parse_args(["serve", "--speculative-method", "eagle"])
    assert args.speculative_method == "eagle"


# The tiny cores below and test_speculative.py's: a budget of 8 tokens gives 5 target graphs (one
# verification) and 4 draft graphs per core instead of 7 and 5; the same sizes share cache entries.
SMALL = dict(max_batch_input_tokens=8)


# ---- --draft-devices ----------------------------------------------------------------------------
def test_cpu_devices_by_id():
    assert devices.parse("cpu:id=2").ids == (2,) and devices.parse("cpu:id=2").count == 1
    assert devices.parse("cpu:2") == devices.DeviceSpec("cpu:2", "cpu", 2)   # a count, as before
    assert devices.host_devices(devices.parse("cpu:id=1,3")) == 4
    with pytest.raises(UserError, match="--draft-devices 'cpu:0,2': cpu:N takes one count"):
        devices.parse("cpu:0,2", "--draft-devices")
    with pytest.raises(UserError, match="--draft-devices cpu:id=9: no device 9"):
        devices.device_groups("cpu:id=9", 1, "--draft-devices")


@pytest.mark.slow
def test_draft_devices_place_the_draft_model(tmp_path):
    """The draft's params on the devices named (default: --devices'), the same output; a
    second engine of the same flags compiles nothing (maxjax/engine/draft.py draft_plan)."""
    import jax
    from tiny_llama import tiny_core, write_tiny_llama
    path = write_tiny_llama(tmp_path / "m")

    def generate(**options):
        core = tiny_core(tmp_path / "m", speculative_method="draft", draft_model_path=path,
                         num_speculative_tokens=2, **SMALL, **options)
        outs = {}
        for i, prompt in enumerate([[5, 6, 7, 8, 9], [10, 11, 12]]):
            core.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                             ignore_eos=True))
        while core.has_unfinished():
            for o in core.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert core.speculator.num_draft_tokens > 0
        params = core.speculator.proposer.model.params
        return outs, {d.id for leaf in jax.tree.leaves(params) for d in leaf.devices()}

    want, where = generate()
    assert where == {0}
    from maxjax.engine import compile_counter
    before = compile_counter.count()
    assert generate() == (want, where)      # the draft's graphs too come from the compile cache
    assert compile_counter.count() == before
    assert generate(draft_devices="cpu:id=2") == (want, {2})
    assert generate(devices="cpu:id=1") == (want, {1})          # inherits --devices
    with pytest.raises(UserError, match="--draft-devices gpu:1: the draft model runs on the "
                                        "target's platform"):
        tiny_core(tmp_path / "m", speculative_method="draft", draft_model_path=path,
                  draft_devices="gpu:1", **SMALL)


@pytest.mark.slow
def test_synthetic_acceptance_through_the_engine(tmp_path):
    """EngineCore.step applies --synthetic-acceptance-rate (ngram drafts on a random model are
    nearly always wrong: at 1.0 all stand, at 0.0 none)."""
    from tiny_llama import tiny_core
    for rate in (1.0, 0.0):
        core = tiny_core(tmp_path / "m", speculative_method="ngram", num_speculative_tokens=2,
                         prompt_lookup_min=1, synthetic_acceptance_rate=rate, **SMALL)
        core.add_request("r", [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6],
                         SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
        while core.has_unfinished():
            core.step()
        spec = core.speculator
        assert spec.num_draft_tokens > 0
        assert spec.num_accepted_tokens == (spec.num_draft_tokens if rate else 0)
