"""The hybrid prefix cache through a real engine (issue 58: state snapshots at page boundaries of
cached prefixes, maxjax/engine/state_slots.py Snapshots, graphs/snapshots.py), shared by the
toy hybrid's tests and the real families': a prompt run cold (the prefix cache emptied first),
then a prompt sharing its first 3 pages, then the cold prompt again, which resumes from the
snapshot at the shared prefix's end and must give the cold run's greedy tokens; a prompt that
diverges inside the first page reuses nothing. And a mixed workload with preemption: every
output equals its cold run, and no request-state slot or snapshot leaks."""
from __future__ import annotations

import numpy as np

from maxjax.engine.types import SamplingParams


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def run(core, requests: dict, n: int, on_step=None) -> dict:
    """{request id: (greedy tokens, cached tokens)} of `requests` ({id: prompt}) run together."""
    for rid, prompt in requests.items():
        core.add_request(rid, prompt, _greedy(n))
    got = {rid: ([], 0) for rid in requests}
    while core.has_unfinished():
        for out in core.step():
            tokens, _ = got[out.request_id]
            got[out.request_id] = (tokens + list(out.new_token_ids), out.cached_tokens)
        if on_step is not None:
            on_step()
    return got


def prompts(core, vocab: int, seed: int = 7) -> dict:
    """A 3-page stem and prompts on it: `first` and `second` share the stem and differ after
    it; `diverged` is `second` with its first token changed."""
    ps = core.layout.page_size
    rng = np.random.default_rng(seed)
    stem = list(map(int, rng.integers(3, vocab, 3 * ps)))
    second = stem + list(map(int, rng.integers(3, vocab, 3)))
    diverged = [3 + (second[0] - 2) % (vocab - 3)] + second[1:]
    return {"first": stem + list(map(int, rng.integers(3, vocab, 5))), "second": second,
            "diverged": diverged, "stem": stem}


def check_no_leaks(core) -> None:
    snaps = core.snapshots
    assert core.state_slots.num_free == core.state_slots.num_slots - 1
    assert snaps.num_pending == 0 and snaps.num_free + snaps.num_bound == snaps.count
    assert all(core.block_manager.is_cached(p) for p in snaps._page_slot)


def check_shared_prefix(core, vocab: int, n: int) -> None:
    """The shared-prefix and diverging-prompt checks on `core` (its prefix cache on)."""
    p = prompts(core, vocab)
    ps = core.layout.page_size
    core.block_manager.reset_prefix_cache()
    cold = run(core, {"cold": p["second"]}, n)["cold"]
    diverged_cold = run(core, {"diverged-cold": p["diverged"]}, n)["diverged-cold"]
    assert cold[1] == 0 and diverged_cold[1] == 0
    core.block_manager.reset_prefix_cache()
    run(core, {"first": p["first"]}, n)
    assert core.snapshots.num_bound > 0                 # its prefill saved state at page ends
    warm = run(core, {"second": p["second"]}, n)["second"]
    assert warm[1] == 3 * ps, warm[1]                   # the whole stem, from its snapshot
    assert warm[0] == cold[0]
    diverged = run(core, {"diverged": p["diverged"]}, n)["diverged"]
    assert diverged[1] == 0 and diverged[0] == diverged_cold[0]
    check_no_leaks(core)


def check_mixed_with_preemption(core, vocab: int, n: int) -> None:
    """Prompts on the stem and off it, batched; every running request preempted once mid-way
    (recomputed, resuming from snapshots where they hit); outputs equal to each prompt's cold
    run, then nothing held but cached pages' snapshots."""
    p = prompts(core, vocab, seed=11)
    rng = np.random.default_rng(12)
    mixed = {f"m{i}": p["stem"][:int(rng.integers(1, len(p["stem"])))]
             + list(map(int, rng.integers(3, vocab, int(rng.integers(2, 12)))))
             for i in range(5)}
    mixed["m5"] = p["first"]
    cold = {}
    for rid, prompt in mixed.items():
        core.block_manager.reset_prefix_cache()
        cold[rid] = run(core, {rid: prompt}, n)[rid][0]
    core.block_manager.reset_prefix_cache()
    run(core, {"warm-up": p["first"]}, n)
    steps, before = [0], core.scheduler.num_preemptions

    def preempt_once():
        steps[0] += 1
        if steps[0] == 6:
            core.scheduler.preempt_running()
    got = run(core, mixed, n, preempt_once)
    assert core.scheduler.num_preemptions > before
    assert any(cached for _, cached in got.values())
    for rid in mixed:
        assert got[rid][0] == cold[rid], rid
    check_no_leaks(core)
