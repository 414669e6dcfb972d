"""The engine on real SmolLM2 weights: batch invariance, chunked prefill, preemption, prefix
cache, seeded sampling, no compilation after warm-up, no leaked pages, bad input."""
import threading

import pytest

from maxjax.engine.types import SamplingParams
from maxjax.errors import RequestError
from maxjax.llm import LLM
from maxjax.models.loader import load_model

pytestmark = pytest.mark.slow     # docs/testing.md: the fast tier is -m 'not slow'

ENGINE = dict(max_length=512, max_batch_size=8, max_batch_input_tokens=32, kv_cache_page_size=16,
              num_kv_pages=48)
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model(None, "float32", progress=False)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def llm_no_prefix(model):
    return LLM(model, enable_prefix_caching=False, **ENGINE)


@pytest.fixture(scope="module")
def prompts(llm):
    base = ("The history of the printing press begins in the fifteenth century, when "
            "Johannes Gutenberg combined movable metal type, oil-based ink and a wooden press. ")
    texts = ["Hello", "The capital of France is", "def fibonacci(n):",
             "List three colors:", base, base * 2 + "In summary,", "1, 2, 3, 4,",
             "Once upon a time there was a"]
    return [llm.encode(t) for t in texts]


@pytest.fixture(autouse=True)
def pool_empty_after(request):
    yield
    for name in ("llm", "llm_no_prefix"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name)
            stats = engine.stats()
            assert stats.kv.pages_used == 0, stats
            assert stats.scheduler.running == 0 and stats.scheduler.waiting == 0, stats


def alone(llm, prompts, params=GREEDY):
    return [llm.generate([p], params)[0].token_ids for p in prompts]


def test_batch_invariance_with_chunked_prefill_and_preemption(llm, prompts):
    # Each request grows to 9-12 pages (76 in all); 8 of them cannot all fit the 47-page pool.
    long = [p + prompts[4] * 3 for p in prompts]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    singles = alone(llm, long, params)
    before = llm.stats().scheduler.preemptions
    together = [o.token_ids for o in llm.generate(long, params)]
    assert together == singles
    assert llm.stats().scheduler.preemptions > before, "the 47-page pool should force preemption"
    assert all(len(t) == params.max_new_tokens for t in together)


def test_batch_invariance_short_prompts(llm, prompts):
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == alone(llm, prompts)


def test_default_encoding_on_the_kernels_is_batch_invariant_to_the_bit(prompts):
    # The embedded GGUF as `maxjax serve` runs it (Q4_1 blocks through the CPU kernels): each
    # row's logprobs do not depend on the rows beside it. The linears and attention are ours
    # (a row's sums in one order); XLA's own reductions were not (graphs/layers.sum_last).
    from maxjax.graphs import cpu_kernels
    if cpu_kernels.unavailable():
        pytest.skip(f"CPU kernels: {cpu_kernels.unavailable()}")
    llm = LLM(None, enable_prefix_caching=False, **ENGINE)
    assert llm.core.layout.attention == "cpu_paged_kernel"
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    logprobs = lambda outs: [[lp.logprob for lp in o.logprobs] for o in outs]   # noqa: E731
    singles = [logprobs(llm.generate([p], params))[0] for p in prompts]
    assert logprobs(llm.generate(prompts, params)) == singles


def test_prefix_caching_off_gives_same_tokens(llm, llm_no_prefix, prompts):
    assert [o.token_ids for o in llm_no_prefix.generate(prompts, GREEDY)] == alone(llm, prompts)
    assert llm_no_prefix.stats().kv.prefix_hit_pages == 0


def test_prefix_cache_reuses_shared_pages(llm, prompts):
    shared = prompts[5][:48]                      # exactly three 16-token pages
    first = shared + llm.encode(" Question one:")
    second = shared + llm.encode(" A different ending")
    llm.generate([first], GREEDY)
    hits = llm.stats().kv.prefix_hit_pages
    cached = llm.generate([second], GREEDY)[0]
    assert llm.stats().kv.prefix_hit_pages - hits >= 3
    assert cached.cached_tokens >= 48
    hits = llm.stats().kv.prefix_hit_pages
    salted = llm.generate([second], GREEDY, cache_salt="fresh-salt")[0]
    assert llm.stats().kv.prefix_hit_pages == hits, "a new cache_salt must reuse nothing"
    assert salted.cached_tokens == 0 and salted.token_ids == cached.token_ids


def test_seeded_sampling_reproducible_alone_and_in_batch(llm, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    a = llm.generate([prompts[1]], params)[0].token_ids
    b = llm.generate([prompts[1]], params)[0].token_ids
    batch = llm.generate([prompts[0], prompts[1], prompts[3]],
                         [SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
                          params, SamplingParams(max_new_tokens=5, temperature=0.0)])
    assert a == b == batch[1].token_ids
    top1 = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=1, seed=5, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert llm.generate([prompts[2]], top1)[0].token_ids == llm.generate([prompts[2]], greedy)[0].token_ids


def test_logprobs_are_consistent(llm, prompts):
    params = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5)
    out = llm.generate([prompts[1]], params)[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert len(lp.top) == 5 and lp.top[0][0] == tok          # greedy: best is chosen
        assert abs(lp.top[0][1] - lp.logprob) < 1e-5
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_stop_string_and_max_tokens_free_pages(llm, prompts):
    out = llm.generate([prompts[6]], SamplingParams(max_new_tokens=30, temperature=0.0,
                                                    stop=[" 7"]))[0]
    assert out.finish_reason == "stop" and " 7" not in out.text and out.text.startswith(" 5")
    out = llm.generate([prompts[6]], SamplingParams(max_new_tokens=3, temperature=0.0))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_abort_frees_pages(llm, prompts):
    core = llm.core
    core.add_request("abort-me", prompts[5], SamplingParams(max_new_tokens=50))
    core.step()                                   # mid-prefill: 32 of ~70 prompt tokens
    assert llm.stats().kv.pages_used > 0
    assert core.abort("abort-me")
    assert llm.stats().kv.pages_used == 0


@pytest.mark.parametrize("prompt,params,field", [
    ([], SamplingParams(), "prompt"),
    (list(range(600)), SamplingParams(), "prompt"),
    ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_p=1.5), "top_p"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(logprobs=True, top_logprobs=21), "top_logprobs"),
])
def test_bad_input_names_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params)
    assert llm.stats().kv.pages_used == 0


def test_two_threads_take_turns(llm, prompts):
    """One LLM from two threads: each call's own output (a second caller's steps took the
    first one's outputs: 'vanished from the engine', deleted buffers)."""
    want = alone(llm, prompts[:2])
    got, errors = {0: [], 1: []}, []

    def run(k):
        try:
            for _ in range(3):
                got[k].append(llm.generate([prompts[k]], GREEDY)[0].token_ids)
        except Exception as e:      # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == {0: [want[0]] * 3, 1: [want[1]] * 3}


def test_prompt_forms_and_bad_prompts(llm):
    text, p = "The capital of France is", SamplingParams(max_new_tokens=4, temperature=0.0)
    a, b, c = llm.generate([text, {"prompt": text}, {"prompt_token_ids": llm.encode(text)}], p)
    assert a.token_ids == b.token_ids == c.token_ids and b.prompt == text and c.prompt is None
    for bad in (None, {"text": text}, [1.5]):
        with pytest.raises(RequestError, match=r"prompts\[1\]: must be a string"):
            llm.generate([text, bad], p)


def test_chat_messages_are_checked(llm):
    p = SamplingParams(max_new_tokens=4, temperature=0.0)
    plain = llm.chat([{"role": "user", "content": "Hi there"}], p)[0]
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}], p)[0]
    assert plain.token_ids == parts.token_ids       # text parts joined, as the server joins them
    with pytest.raises(RequestError, match=r"messages\[0\]\.content: a string is required"):
        llm.chat([{"role": "user"}])
    with pytest.raises(RequestError, match=r"messages\[0\]: must be a dict with a string 'role'"):
        llm.chat([{"content": "hi"}])


def test_profile_accounts_for_every_step(llm, prompts):
    before = dict(llm.core.profile)
    llm.generate([prompts[1]], SamplingParams(max_new_tokens=3, temperature=0.0))
    prof = llm.core.profile
    assert prof["steps"] - before["steps"] == 3         # one prefill step, two decodes
    assert prof["device_step"] > before["device_step"] and prof["schedule"] > before["schedule"]
    report = llm.profile_report()
    assert "device_step" in report and "detokenize" in report


def test_no_compilation_after_warmup(llm, llm_no_prefix):
    # Runs last in this module: every workload above went through the compiled buckets only.
    assert llm.stats().xla_compiles_since_ready == 0
    assert llm_no_prefix.stats().xla_compiles_since_ready == 0


def test_prompt_logprobs_match_generated_logprobs(llm, prompts):
    """Scoring a prompt + its greedy continuation gives, at the continuation's positions, the
    logprobs the continuation was generated with (chunked prefill covers the prompt in pieces)."""
    gen = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)
    first = llm.generate([prompts[5]], gen)[0]
    scored_ids = prompts[5] + first.token_ids
    echo = SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=True, top_logprobs=3)
    scored = llm.generate([scored_ids], echo)[0]
    plps = scored.prompt_logprobs
    assert len(plps) == len(scored_ids) and plps[0] is None
    n = len(prompts[5])
    for i, lp in enumerate(first.logprobs):
        got = plps[n + i]
        assert got.token_id == scored_ids[n + i]
        assert abs(got.logprob - lp.logprob) < 1e-4
        assert [t for t, _ in got.top] == [t for t, _ in lp.top]
    assert all(p.logprob <= 0 for p in plps[1:])


def test_priming_runs_every_executable_and_changes_nothing(llm, prompts):
    before = alone(llm, prompts[:2])
    llm.core.warmup()                      # compiles nothing new; re-arms the priming steps
    runs = 0
    while llm.core.prime_next():
        runs += 1
    assert runs == 2 * len(llm.core.runner.buckets)
    assert not llm.core.prime_next()
    assert alone(llm, prompts[:2]) == before
