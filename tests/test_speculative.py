"""Speculative decoding: the speculator's choices with the mock model, and n-gram speculation on
real SmolLM2 weights against the same engine without it: identical greedy (and seeded) output for
batched prompts of different lengths, with the prefix cache and with preemption, stop strings and
stop tokens inside an accepted run, logprobs, no compilation after warm-up, no leaked pages."""
import pytest

from maxjax.engine import spec_flags, speculative
from maxjax.engine.block_manager import BlockManager
from maxjax.engine.config import EngineConfig
from maxjax.engine.request import Request
from maxjax.engine.scheduler import Scheduler
from maxjax.engine.stats import EngineStats
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from maxjax.llm import LLM
from maxjax.models.loader import load_model
from mock_model import MockModel, reference_generate
from pool_check import check_pool

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

# as tests/test_engine_smollm2.py: the plain graphs come from the persistent compile cache
ENGINE = dict(max_length=512, max_batch_size=8, max_batch_input_tokens=32, kv_cache_page_size=16,
              num_kv_pages=48)
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
VOCAB, PAGE = 1000, 4


# ---- the speculator on the mock model ------------------------------------------------------------
class Oracle:
    """Proposes what the mock model will generate, `wrong` flipping the first draft."""
    def __init__(self, prompts, wrong=()):
        self.ref = {rid: (len(p), reference_generate(p, 200, VOCAB)) for rid, p in prompts.items()}
        self.wrong = set(wrong)

    def propose(self, requests, k):
        out = []
        for r in requests:
            n, ref = self.ref[r.request_id]
            drafts = list(ref[r.num_tokens - n:r.num_tokens - n + k])
            if r.request_id in self.wrong and drafts:
                drafts[0] = (drafts[0] + 1) % VOCAB
            out.append(drafts)
        return out

    def observe(self, rows, results):
        pass


class Result:
    def __init__(self, tokens):
        self.token_ids = tokens if isinstance(tokens, list) else [tokens]


def run_mock(prompts, cost, wrong=(), k=3, greedy_only=False, params=None):
    """Generate with the mock model and an Oracle proposer; `cost(bucket)`: the step times the
    speculator is told. Returns (outputs, drafts per step, speculator)."""
    cfg = EngineConfig(max_batch_size=4, max_batch_input_tokens=16, kv_cache_page_size=PAGE)
    from maxjax.engine.buckets import bucket_set
    buckets = bucket_set(16, 4, k + 1)
    bm = BlockManager(64, PAGE, True)
    sched = Scheduler(cfg, bm, 256, (), max_draft_tokens=k)
    spec = speculative.Speculator(Oracle(prompts, wrong), k, buckets, 4, 16, greedy_only)
    model = MockModel(PAGE, VOCAB)
    reqs = {rid: Request(rid, p, params or SamplingParams(max_new_tokens=24))
            for rid, p in prompts.items()}
    for r in reqs.values():
        sched.add(r)
    drafted = []
    from maxjax.engine.buckets import pick_bucket
    while sched.has_unfinished():
        spec.propose(sched)
        plan = sched.schedule()
        sampled = model.run(plan.rows)
        n = sum(len(r.token_ids) for r in plan.rows)
        b = pick_bucket(buckets, n, len(plan.rows), sum(r.num_samples for r in plan.rows))
        spec.observe(plan.rows, [Result(t) for t in sampled], b, cost(b))
        drafted.append(sum(len(r.draft_token_ids) for r in plan.rows))
        sched.update(plan, sampled)
        check_pool(bm, [r for r in reqs.values() if not r.is_finished])
    for rid, p in prompts.items():
        assert reqs[rid].output_token_ids == reference_generate(p, 24, VOCAB)
    assert bm.num_used_pages == 0
    return reqs, drafted, spec


PROMPTS = {"a": list(range(30, 41)), "b": list(range(50, 55))}


def test_drafts_that_cost_nothing_are_taken():
    _, drafted, spec = run_mock(PROMPTS, lambda b: 0.01)
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    assert sum(d > 0 for d in drafted) > len(drafted) // 2
    assert spec.stats().accepted_at[0] == spec.stats().drafted_at[0]


def test_drafts_stop_when_their_bucket_costs_more_than_they_bring():
    # a step with drafts takes 10x the one without: after trying each bucket once, no drafts
    _, drafted, spec = run_mock(PROMPTS, lambda b: 0.01 if b.num_tokens <= 2 else 0.1)
    assert sum(drafted[-8:]) == 0
    assert spec.step_seconds


def test_a_request_whose_drafts_fail_stops_getting_them():
    reqs, drafted, spec = run_mock(PROMPTS, lambda b: 0.01 if b.num_tokens <= 2 else 0.015,
                                   wrong={"a"})
    assert reqs["a"].spec_counts[0] == 0 and reqs["b"].spec_counts[0] > 0
    assert spec._rate(reqs["a"]) < 0.3 < spec._rate(reqs["b"])


def test_greedy_only_and_grammar_requests_do_not_speculate():
    sampled = SamplingParams(max_new_tokens=24, temperature=0.7)
    _, drafted, spec = run_mock(PROMPTS, lambda b: 0.01, greedy_only=True, params=sampled)
    assert sum(drafted) == 0
    req = Request("g", [1, 2], SamplingParams(temperature=0.0))
    assert speculative.may_speculate(req, True)
    req.grammar = object()
    assert not speculative.may_speculate(req, False)


@pytest.mark.parametrize("options,message", [
    (dict(num_speculative_tokens=3), "needs --speculative-method"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), ">= 1"),
    (dict(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "min <= max"),
    (dict(speculative_method="draft"), "--draft-model-path"),
    (dict(speculative_method="ngram", draft_model_path="x"), "--draft-model-path"),
])
def test_bad_speculation_flags(options, message):
    with pytest.raises(UserError, match=message):
        spec_flags.draft_tokens(EngineConfig(**options))


def test_defaults_and_verification_buckets():
    from maxjax.engine.buckets import bucket_set
    assert spec_flags.draft_tokens(EngineConfig(speculative_method="ngram")) == 7
    buckets = bucket_set(32, 8, 8)
    assert [(b.num_tokens, b.num_rows, b.num_samples) for b in buckets if b.num_samples > b.num_rows] \
        == [(16, 8, 16), (32, 8, 32)]
    assert {b.name for b in buckets} >= {"step_t32_r8", "step_t32_r8_s32"}


# ---- SmolLM2 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return load_model(None, "float32", progress=False)


@pytest.fixture(scope="module")
def base(model):
    return LLM(model, **ENGINE)


# The speculating engines draft the same number of tokens, so they share one bucket set: the
# first one built compiles it, the others load it from the compile cache.
SPEC_TOKENS = 3


@pytest.fixture(scope="module")
def ngram(model):
    return LLM(model, speculative_method="ngram", num_speculative_tokens=SPEC_TOKENS, **ENGINE)


@pytest.fixture(scope="module")
def self_draft(model):
    from maxjax.models.loader import embedded_model_path
    return LLM(model, speculative_method="draft", draft_model_path=embedded_model_path(),
               num_speculative_tokens=SPEC_TOKENS, **ENGINE)


@pytest.fixture(scope="module")
def random_draft(model, tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's tokenizer and vocabulary."""
    from tiny_llama import write_tiny_llama
    path = write_tiny_llama(tmp_path_factory.mktemp("draft"), tokenizer=model.tokenizer,
                            vocab_size=model.config.vocab_size)
    return LLM(model, speculative_method="draft", draft_model_path=path,
               num_speculative_tokens=SPEC_TOKENS, **ENGINE)


@pytest.fixture(autouse=True)
def pool_empty_after(request):
    yield
    for name in ("base", "ngram", "self_draft", "random_draft"):
        if name in request.fixturenames:
            llm = request.getfixturevalue(name)
            stats = llm.stats()
            assert stats.kv.pages_used == 0, stats
            assert stats.scheduler.running == stats.scheduler.waiting == 0, stats
            proposer = llm.core.speculator and llm.core.speculator.proposer
            if hasattr(proposer, "bm"):                 # the draft model's own pool
                assert proposer.bm.num_used_pages == 0 and not proposer.live


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press. ")


@pytest.fixture(scope="module")
def prompts(base):
    texts = ["Hello", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
             TEXT * 2 + "The history", "def fibonacci(n):", "Once upon a time there was a",
             "a b c d e f g h a b c d e f g h a b c", TEXT + "In summary,"]
    return [base.encode(t) for t in texts]


def accepted(llm) -> int:
    return llm.stats().spec.accepted_tokens


@pytest.fixture(scope="module")
def want(base, prompts):
    return [o.token_ids for o in base.generate(prompts, GREEDY)]


def acceptance(llm, before: EngineStats) -> float:
    s = llm.stats()
    return ((s.spec.accepted_tokens - before.spec.accepted_tokens)
            / (s.spec.draft_tokens - before.spec.draft_tokens))


def test_greedy_output_identical_batched(ngram, prompts, want):
    before = accepted(ngram)
    got = [o.token_ids for o in ngram.generate(prompts, GREEDY)]
    assert got == want
    assert accepted(ngram) - before > 40          # the repetitive prompts copy themselves
    again = [o.token_ids for o in ngram.generate(prompts[::-1], GREEDY)][::-1]
    assert again == want                          # prefix-cached prompts, other neighbours
    assert ngram.stats().kv.prefix_hit_pages > 0


LONG = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_prompts(prompts):
    return [p + prompts[2] * 2 for p in prompts]  # ~10 pages each: 7 do not fit 47 pages


@pytest.fixture(scope="module")
def want_long(base, long_prompts):
    return [o.token_ids for o in base.generate(long_prompts, LONG)]


def test_greedy_output_identical_with_preemption(ngram, long_prompts, want_long):
    before = ngram.stats().scheduler.preemptions, accepted(ngram)
    assert [o.token_ids for o in ngram.generate(long_prompts, LONG)] == want_long
    assert ngram.stats().scheduler.preemptions > before[0]
    assert accepted(ngram) > before[1]


def test_seeded_sampling_and_logprobs_unchanged(base, ngram, prompts):
    params = [SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=11 + i,
                             repetition_penalty=1.05, ignore_eos=True, logprobs=True,
                             top_logprobs=2) for i in range(3)]
    want = base.generate(prompts[1:4], params)
    got = ngram.generate(prompts[1:4], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert [lp.token_id for lp in a.logprobs] == a.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


def test_stops_inside_an_accepted_run(base, ngram, prompts):
    counting = prompts[1]                          # "... 1, 2, 3," goes on " 4, 5, 6, 7, ..."
    for params in (SamplingParams(max_new_tokens=30, temperature=0.0, stop=[" 7"]),
                   SamplingParams(max_new_tokens=30, temperature=0.0, stop=["6,"]),
                   SamplingParams(max_new_tokens=30, temperature=0.0,
                                  stop_token_ids=[base.encode(" 8")[-1]]),
                   SamplingParams(max_new_tokens=5, temperature=0.0)):
        want = base.generate([counting], params)[0]
        before = accepted(ngram)
        got = ngram.generate([counting], params)[0]
        assert (got.text, got.token_ids, got.finish_reason) == \
            (want.text, want.token_ids, want.finish_reason)
        assert accepted(ngram) > before, "the stop should come inside a verified run"
    assert want.finish_reason == "length" and len(want.token_ids) == 5


def test_profile_and_stats_report_acceptance(ngram):
    report = ngram.profile_report()
    assert "acceptance rate by position" in report
    stats = ngram.stats()
    assert len(stats.spec.drafted_at) == SPEC_TOKENS
    assert stats.spec.accepted_at[0] <= stats.spec.drafted_at[0]


def test_smollm2_drafting_for_itself_accepts_nearly_everything(self_draft, prompts, want):
    before = self_draft.stats()
    assert [o.token_ids for o in self_draft.generate(prompts, GREEDY)] == want
    assert acceptance(self_draft, before) > 0.95


def test_draft_output_identical_with_preemption(self_draft, long_prompts, want_long):
    before = self_draft.stats()
    assert [o.token_ids for o in self_draft.generate(long_prompts, LONG)] == want_long
    assert self_draft.stats().scheduler.preemptions > before.scheduler.preemptions
    assert self_draft.stats().spec.accepted_tokens > before.spec.accepted_tokens


def test_random_draft_changes_nothing_and_is_rarely_right(random_draft, prompts, want):
    before = random_draft.stats()
    assert [o.token_ids for o in random_draft.generate(prompts, GREEDY)] == want
    assert random_draft.stats().spec.rows_verified > before.spec.rows_verified
    assert acceptance(random_draft, before) < 0.2


def test_draft_with_another_vocabulary_is_a_user_error(model, tmp_path):
    from tiny_llama import write_tiny_llama
    path = write_tiny_llama(tmp_path / "other")         # 512 ids, a word-level tokenizer
    with pytest.raises(UserError, match="vocabulary"):
        LLM(model, speculative_method="draft", draft_model_path=path, **ENGINE)
    with pytest.raises(UserError, match="--draft-devices"):
        LLM(model, speculative_method="draft", draft_model_path=path, draft_devices="tpu",
            **ENGINE)


def test_no_compilation_after_warmup(base, ngram, self_draft, random_draft):
    for llm in (base, ngram, self_draft, random_draft):
        assert llm.stats().xla_compiles_since_ready == 0


def test_metrics_show_acceptance_by_position(ngram):
    from prometheus_client.parser import text_string_to_metric_families
    from maxjax.engine.async_engine import AsyncEngine
    from maxjax.server.metrics import ServerMetrics

    class Engine:          # AsyncEngine's stats() over this core's numbers
        stats = lambda self: AsyncEngine.stats(self)          # noqa: E731
        _stats = ngram.stats()
    samples = {(s.name, s.labels.get("position")): s.value for fam in text_string_to_metric_families(
        ServerMetrics(Engine()).render().decode()) for s in fam.samples}
    stats = ngram.stats()
    assert samples[("maxjax_spec_decode_num_accepted_tokens_total", None)] == \
        stats.spec.accepted_tokens > 0
    assert samples[("maxjax_spec_decode_acceptance_rate", "0")] == \
        stats.spec.accepted_at[0] / stats.spec.drafted_at[0]
    assert samples[("maxjax_spec_decode_mean_accepted_tokens", None)] > 0


def test_artifacts_hold_the_verification_buckets(tmp_path):
    """warm-cache's graphs are the layout's, verification buckets included; artifacts built
    without speculation are refused (before anything is deserialized) with the command that
    builds the right ones."""
    from maxjax.aot import export as aot_export
    from maxjax.engine.build import build_core
    from maxjax.engine.plan import EnginePlan, plan_layout
    from tiny_llama import write_tiny_llama
    tiny = load_model(write_tiny_llama(tmp_path / "tiny"), "float32", progress=False)
    # one row, 4 tokens: two verification buckets, 5 graphs (3 without speculation)
    engine = dict(max_batch_size=1, max_batch_input_tokens=4, max_length=64, num_kv_pages=16,
                  kv_cache_page_size=16, quantization_encoding="float32")
    spec_cfg = EngineConfig(speculative_method="ngram", num_speculative_tokens=3, **engine)
    aot_export.write_artifacts(str(tmp_path / "spec"), tiny, EnginePlan(spec_cfg, plan_layout(spec_cfg, tiny)),
                               ["cpu"], progress=False)
    plain = EngineConfig(**engine)
    aot_export.write_artifacts(str(tmp_path / "plain"), tiny, EnginePlan(plain, plan_layout(plain, tiny)),
                               ["cpu"], progress=False)
    import json
    with open(tmp_path / "spec" / "manifest.json") as f:
        names = {g["name"] for g in json.load(f)["graphs"]}
    assert {"step_t4_r1", "step_t4_r1_s4", "step_t2_r1_s2"} <= names     # (serving them: test_aot)
    with pytest.raises(UserError, match="--speculative-method ngram --num-speculative-tokens 3"):
        build_core(tiny, EngineConfig(speculative_method="ngram", num_speculative_tokens=3,
                                      **engine), precompiled_artifacts=[str(tmp_path / "plain")])


def test_a_failing_proposer_costs_only_the_drafts(tmp_path):
    """A draft-model call that raises: the step verifies no drafts, the draft cache starts over,
    and the output is the same as without speculation."""
    from test_speculative_flags import SMALL      # its sizes: the target's graphs are cached
    from tiny_llama import tiny_core, write_tiny_llama
    path = write_tiny_llama(tmp_path / "m")
    core = tiny_core(tmp_path / "m", speculative_method="draft", draft_model_path=path,
                     num_speculative_tokens=2, **SMALL)
    proposer, run = core.speculator.proposer, core.speculator.proposer.runner.run
    calls = {"n": 0}

    def flaky(rows):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("draft step failed")
        return run(rows)
    proposer.runner.run = flaky
    outs = {}
    for i, prompt in enumerate([[5, 6, 7, 8, 9], [10, 11, 12]]):
        core.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                         ignore_eos=True))
    while core.has_unfinished():
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.finish_reason in (None, "length")
    core.speculator = None
    core.scheduler.max_draft_tokens = 0
    for i, prompt in enumerate([[5, 6, 7, 8, 9], [10, 11, 12]]):
        core.add_request(f"s{i}", prompt, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                         ignore_eos=True))
    while core.has_unfinished():
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert outs["r0"] == outs["s0"] and outs["r1"] == outs["s1"] and calls["n"] > 3
    check_pool(proposer.bm, [r.draft_state for r in proposer.live])   # no page lost on a reset


def test_warm_cache_writes_the_draft_models_graphs(tmp_path):
    """warm-cache with a draft model also writes the draft's graphs (DIR/draft); an engine from
    DIR with the compile cache off compiles nothing while it drafts (the draft is the target
    itself: its drafts are accepted); a flipped byte there is refused like in any artifact."""
    import json

    from maxjax.cli.main import _setup, build_parser
    from maxjax.engine import compile_counter, warm
    from maxjax.engine.build import build_core
    from tiny_llama import write_tiny_llama
    path = str(write_tiny_llama(tmp_path / "m"))
    flags = ["--speculative-method", "draft", "--draft-model-path", path,
             "--num-speculative-tokens", "2", "--max-batch-size", "2", "--max-batch-input-tokens",
             "4", "--max-length", "64", "--num-kv-pages", "24", "--kv-cache-page-size", "8",
             "--quantization-encoding", "float32"]
    args = build_parser().parse_args(["warm-cache", "--model-path", path, *flags])
    model_opts, cfg = _setup(args)
    art = str(tmp_path / "art")
    assert warm.warm_cache(model_opts, cfg, art, None, 1) == 0
    with open(tmp_path / "art" / "draft" / "manifest.json") as f:
        assert {g["name"] for g in json.load(f)["graphs"]} == {
            "step_t1_r1", "step_t2_r2", "step_t4_r2", "sample_s1", "sample_s2",
            "kv_init"}                                                   # plain buckets
    before = compile_counter.count()
    core = build_core(path, cfg, precompiled_artifacts=[art], compile_cache=False)
    assert compile_counter.count() == before
    runner = core.speculator.proposer.runner
    assert {e.source for e in runner.executables.values()} == {"executable"}
    outs = {}
    core.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=12, temperature=0.0,
                                                          ignore_eos=True))
    while core.has_unfinished():
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert core.speculator.num_accepted_tokens > 0 and compile_counter.count() == before
    exe = tmp_path / "art" / "draft" / "step_t1_r1.cpu-cpu.xlaexe"
    blob = bytearray(exe.read_bytes())
    blob[len(blob) // 2] ^= 1
    exe.write_bytes(bytes(blob))
    with pytest.raises(UserError, match=r"draft/manifest.json: graph step_t1_r1: executable file .*"
                       r"sha256 .* with --speculative-method draft --draft-model-path"):
        build_core(path, cfg, precompiled_artifacts=[art], compile_cache=False)
