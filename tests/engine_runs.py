"""Requests run through a real EngineCore to their end, for the engine and model tests:
`run_to_end` (each request's outputs merged), `run_tokens` (each request's tokens, and the
steps taken) and `run_preempting` (the same with every running request preempted once
mid-decode: recomputed from its prompt and tokens so far)."""
from __future__ import annotations

from maxjax.engine.output import merge_outputs


def run_to_end(core, requests: dict) -> dict:
    """Every request ({id: (prompt, SamplingParams)}) to its end: id -> its outputs merged."""
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    got = {rid: [] for rid in requests}
    while core.has_unfinished():
        for out in core.step():
            got[out.request_id].append(out)
    assert all(outs[-1].finished for outs in got.values())
    return {rid: merge_outputs(outs) for rid, outs in got.items()}


def run_tokens(core, prompts: dict, sampling, on_step=None) -> tuple[dict, int]:
    """({id: tokens}, steps) of `prompts` ({id: prompt}, added in order) run together to their
    end; `on_step(tokens)` after each step."""
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, sampling)
    tokens = {rid: [] for rid in prompts}
    steps = 0
    while core.has_unfinished():
        steps += 1
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if on_step is not None:
            on_step(tokens)
    return tokens, steps


def run_preempting(core, prompts: dict, sampling, victim: str, after: int = 5,
                   on_preempt=None) -> dict:
    """run_tokens' tokens, every running request preempted once `victim` has `after` tokens
    (then `on_preempt()`, e.g. the prefix cache emptied). Asserts the preemption happened."""
    preempted = []

    def preempt_once(tokens):
        if len(tokens[victim]) >= after and not preempted:
            core.scheduler.preempt_running()
            if on_preempt is not None:
                on_preempt()
            preempted.append(core.scheduler.num_preemptions)
    tokens, _ = run_tokens(core, prompts, sampling, preempt_once)
    assert preempted and preempted[0]
    return tokens
