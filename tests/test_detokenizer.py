"""Incremental detokenization (real SmolLM2 tokenizer + a tiny sentencepiece-style one) and stop strings."""
import os

import pytest

from maxjax.engine.detokenizer import IncrementalDetokenizer, StopChecker, TextStream
from maxjax.engine.types import SamplingParams

MULTIBYTE = "Hello 世界! 🎉 naïve café — 日本語のテキスト 👩‍👩‍👧 done."


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    from maxjax.models.loader import embedded_model_path
    path = embedded_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def sp_tok():
    """Sentencepiece-style spacing: '▁' marks a space, and a lone token decodes without it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, "▁world": 3, "!": 4, "▁again": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, ids, chunk=1, **kw):
    d = IncrementalDetokenizer(tokenizer, **kw)
    deltas = [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(d.flush())
    return d, deltas


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multibyte_token_by_token_equals_full_decode(tok, chunk):
    ids = tok.encode(MULTIBYTE)
    single = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in single)          # the text really splits characters
    d, deltas = stream(tok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE == d.text
    assert not any("\ufffd" in x for x in deltas)
    assert deltas[-1] == ""                            # nothing was left for flush


def test_prompt_context_and_special_tokens(tok):
    prompt = tok.encode("<|im_start|>assistant\n")
    out = tok.encode(" Sure, 你好") + [tok.eos_token_id]
    d, deltas = stream(tok, out, prompt_ids=prompt)
    assert d.text == " Sure, 你好"
    d, _ = stream(tok, out, prompt_ids=prompt, skip_special_tokens=False)
    assert d.text == " Sure, 你好" + tok.eos_token


def test_incomplete_character_is_held_until_flush(tok):
    ids = tok.encode("ok 🎉")
    partial = ids[:-1]                                 # the emoji's last byte token is missing
    assert tok.decode(partial).endswith("\ufffd")
    d = IncrementalDetokenizer(tok)
    emitted = "".join(d.add([i]) for i in partial)
    assert "\ufffd" not in emitted and emitted == "ok"
    assert d.flush().endswith("\ufffd")                # at the end, what is there is emitted


def test_sentencepiece_spacing(sp_tok):
    ids = [2, 3, 4, 5, 1]
    assert sp_tok.decode([3]) == "world"               # decoding alone loses the space
    d, deltas = stream(sp_tok, ids)
    assert deltas[:4] == ["Hello", " world", "!", " again"]
    assert d.text == "Hello world! again"
    d, _ = stream(sp_tok, [3, 4], prompt_ids=[2])      # first output token after a prompt
    assert d.text == " world!"


def test_stop_checker_holds_a_split_stop_string():
    s = StopChecker(["STOP", "\n\n"])
    out = [s.feed(x) for x in ["Hel", "lo S", "TO", "P and more"]]
    assert "".join(out) == "Hello " and s.matched == "STOP" and s.stopped
    assert out == ["Hel", "lo ", "", ""]               # "S", then "STO" held: they could start "STOP"
    assert s.feed("more") == "" and s.flush() == ""


def test_stop_checker_earliest_match_and_flush():
    s = StopChecker(["world", "lo w"])
    assert s.feed("hello world") == "hel" and s.matched == "lo w"
    s = StopChecker(["xyz", "x!"])
    assert s.feed("abcx") == "abc"
    assert s.feed("y") == ""
    assert s.feed("x") == "xy"                         # "xyx": only the last "x" can still match
    assert s.flush() == "x"                            # no stop: the tail goes out at the end
    none = StopChecker([])
    assert none.feed("abc") == "abc" and none.flush() == ""


@pytest.mark.parametrize("stop", [["\nUser:"], ["界"], ["🎉 na", "zzz"]])
def test_text_stream_stop_strings_split_across_tokens(tok, stop):
    text = "The answer is 42 世界!\nUser: 🎉 naïve hi"
    ids = tok.encode(text)
    first = min(text.find(s) for s in stop if s in text)
    ts = TextStream(tok, SamplingParams(stop=stop))
    pieces = []
    for i in ids:
        pieces.append(ts.add([i]))
        if ts.stopped:
            break
    else:
        pieces.append(ts.finish())
    assert ts.stopped
    assert "".join(pieces) == ts.text == text[:first]


def test_text_stream_without_stop_emits_everything(tok):
    ids = tok.encode(MULTIBYTE)
    ts = TextStream(tok, SamplingParams(stop=["never"]))
    pieces = [ts.add([i]) for i in ids] + [ts.finish()]
    assert not ts.stopped and "".join(pieces) == MULTIBYTE
