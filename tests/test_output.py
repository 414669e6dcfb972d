"""The output processor on hand-made step updates (byte-level tokenizer: token id = byte): text and
stop strings inside a multi-token update, stop token ids kept out of the text, logprobs and prompt
logprobs, a failure that stays with its request, merging queued outputs."""
from __future__ import annotations

import numpy as np
import pytest

from maxjax.engine.output import OutputProcessor, keep_prompt_logprobs, merge_outputs
from maxjax.engine.request import Request, RequestStatus
from maxjax.engine.runner import Sample
from maxjax.engine.scheduler import StepUpdate
from maxjax.engine.types import SamplingParams
from mock_engine import byte_tokenizer


@pytest.fixture(scope="module")
def proc():
    return OutputProcessor(byte_tokenizer())


def sample(t: int) -> Sample:
    return Sample(t, -0.1 * (t % 7), np.array([t, t + 1]), np.array([-0.1, -2.0]))


def step(proc, req: Request, text: str, finish: str | None = None):
    """What Scheduler.update_from_output would hand over after appending `text`'s bytes to
    `req`."""
    ids = list(text.encode())
    for t in ids:
        req.append_token(t)
    if finish:
        req.status, req.finish_reason = RequestStatus.FINISHED, finish
    return proc.process([StepUpdate(req, ids, [sample(t) for t in ids])])[0]


def request(rid="r", **params) -> Request:
    req = Request(rid, list(b"Q:"), SamplingParams(**params))
    req.status = RequestStatus.RUNNING
    return req


def test_stop_string_inside_a_multi_token_update_cuts_tokens_and_text(proc):
    req = request(stop=["lo w"])
    assert step(proc, req, "hel").new_text == "he"          # "l" might start the stop string
    out = step(proc, req, "lo world")
    assert out.finished and out.finish_reason == "stop"
    assert out.new_text == "l" and bytes(out.new_token_ids) == b"lo w"
    assert out.completion_tokens == 7 and req.text.text == "hel"


def test_stop_strings_wait_for_min_tokens(proc):
    """vLLM's rule: a stop string in the first min_tokens tokens does not end the request."""
    assert step(proc, request(stop=["l"]), "hello").new_text == "he"
    out = step(proc, request(stop=["l"], min_tokens=4), "hello")
    assert out.finished and out.finish_reason == "stop"
    assert out.new_text == "hel" and out.completion_tokens == 4


def test_stop_token_ends_without_appearing_in_the_text(proc):
    req = request(stop_token_ids=[ord("!")])
    out = step(proc, req, "hi!", finish="stop")
    assert out.finished and out.finish_reason == "stop"
    assert out.new_text == "hi" and bytes(out.new_token_ids) == b"hi!"


def test_logprobs_are_those_of_the_text_out(proc):
    """A token's logprob comes out with its text: held while a stop string may be starting,
    dropped with a matched stop string (the text and the logprobs' tokens join to the same)."""
    req = request(stop=["5."], logprobs=True)
    first = step(proc, req, "4\n5")                       # "5" might start "5."
    assert first.new_text == "4\n" and bytes(t.token_id for t in first.new_logprobs) == b"4\n"
    last = step(proc, req, ".6")
    assert last.finished and last.new_text == "" and last.new_logprobs == []
    assert bytes(last.new_token_ids) == b"." and last.completion_tokens == 4
    req = request(stop=["5."], logprobs=True)                # no stop: all of them, in order
    assert bytes(t.token_id for t in step(proc, req, "45").new_logprobs) == b"4"
    out = step(proc, req, "6", finish="length")
    assert out.new_text == "56" and bytes(t.token_id for t in out.new_logprobs) == b"56"
    req = request(stop_token_ids=[ord("!")], logprobs=True)   # a stop token keeps its own, last
    out = step(proc, req, "hi!", finish="stop")
    assert out.new_text == "hi" and bytes(t.token_id for t in out.new_logprobs) == b"hi!"


def test_logprobs_and_prompt_logprobs_with_the_first_output_only(proc):
    req = request(logprobs=True, top_logprobs=1, prompt_logprobs=True)
    keep_prompt_logprobs(req, 0, 2, (np.array([-1.0, -9.0]), np.array([[7, 8], [9, 9]]),
                                     np.array([[-0.5, -3.0], [-0.2, -0.2]])))
    first = step(proc, req, "ab")
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == 2
    assert (first.prompt_logprobs[1].token_id, first.prompt_logprobs[1].top) == (ord(":"), [(7, -0.5)])
    assert [lp.token_id for lp in first.new_logprobs] == list(b"ab")
    assert first.new_logprobs[0].top == [(ord("a"), -0.1)]
    later = step(proc, req, "c", finish="length")
    assert later.prompt_logprobs is None and later.finish_reason == "length"
    assert not req.prompt_logprobs


def test_a_failure_stays_with_its_request(proc):
    ok, bad = request("ok"), request("bad")
    bad.text = object()                 # a broken detokenizer state
    outs = proc.process([StepUpdate(bad, [1], [sample(1)]),
                         StepUpdate(ok, [ord("x")], [sample(ord("x"))])])
    assert outs[0].finish_reason == "error" and "output processing failed" in outs[0].error
    assert not outs[1].finished and outs[1].new_text == "x"


def test_merge_joins_tokens_text_and_logprobs(proc):
    req = request(logprobs=True)
    outs = [step(proc, req, "ab"), step(proc, req, "cd", finish="length")]
    merged = merge_outputs(outs)
    assert bytes(merged.new_token_ids) == b"abcd" and merged.new_text == "abcd"
    assert len(merged.new_logprobs) == 4 and merged.finish_reason == "length"
    assert merged.completion_tokens == 4 and merge_outputs(outs[:1]) is outs[0]
