"""Constrained decoding on real SmolLM2 weights (maxjax.LLM): every output of 24 JSON schemas,
greedy and sampled, validates with jsonschema; json_object parses; regex, choice and a Lark
grammar hold; unconstrained neighbours are untouched; a matcher error ends its request; bad
grammars and compile timeouts are RequestErrors naming the field. No compile after warm-up, no
page leaked."""
import ast
import json
import re

import jsonschema
import numpy as np
import pytest
from structured_schemas import SCHEMAS, prompt

from maxjax.engine.types import SamplingParams
from maxjax.errors import RequestError
from maxjax.llm import LLM
from maxjax.structured import GrammarSpec

ENGINE = dict(max_length=512, max_batch_size=16, max_batch_input_tokens=128,
              kv_cache_page_size=16, num_kv_pages=300)
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)~0..3
term: factor (("*" | "/") factor)~0..2
factor: NUMBER | "(" inner ")"
inner: NUMBER (("+" | "-" | "*" | "/") NUMBER)~1..2
NUMBER: /[0-9]{1,2}/
"""


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(autouse=True)
def no_leak_no_compile(llm):
    yield
    stats = llm.stats()
    assert stats.kv.pages_used == 0, stats
    assert stats.scheduler.running == 0 and stats.scheduler.waiting == 0, stats
    assert stats.xla_compiles_since_ready == 0


def params(spec, sampled: bool, seed: int = 0, max_new: int = 160,
           temperature: float = 0.9) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=temperature if sampled else 0.0,
                          top_p=0.95, seed=seed, structured_output=spec)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_json_schemas_validate(llm, sampled):
    prompts = [llm.apply_chat_template(prompt(what)) for what, _ in SCHEMAS]
    # A JSON number has no length bound in any grammar: at 0.9 this 135M model can write digits
    # until max_tokens (seeded draws are fixed, so this is a choice of draw, not luck per run).
    outs = llm.generate(prompts, [params(GrammarSpec.json_schema(s), sampled, seed=100 + i)
                                  for i, (_, s) in enumerate(SCHEMAS)])
    for (what, schema), out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", (what, out.text, out.finish_reason, out.error)
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_parses(llm):
    """Any object: nothing bounds it but the model, so the sampled ones run cool (at 0.5-0.9
    this 135M model may nest or add keys until max_tokens)."""
    p = llm.apply_chat_template([{"role": "user", "content": 'Reply with a JSON object with the '
                                                              'keys "name" and "color" of a cat.'}])
    outs = llm.generate([p] * 4, [params(GrammarSpec.json_object(), s > 0, seed=s, max_new=200,
                                         temperature=0.3) for s in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert isinstance(json.loads(out.text), dict)


def test_regex_choice_and_lark(llm):
    p = llm.apply_chat_template([{"role": "user", "content": "Give me a phone number."}])
    q = llm.apply_chat_template([{"role": "user", "content": "Is the sky blue?"}])
    m = llm.apply_chat_template([{"role": "user", "content": "Write a sum of numbers."}])
    regex = r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"
    choices = ["yes", "no", "maybe"]
    specs = [GrammarSpec.regex(regex), GrammarSpec.choice(choices), GrammarSpec.lark(ARITHMETIC)]
    outs = llm.generate([p, q, m] * 2, [params(s, sampled, seed=i, max_new=160)
                                        for sampled in (False, True)
                                        for i, s in enumerate(specs)])
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", out.text
        if i % 3 == 0:
            assert re.fullmatch(regex, out.text), out.text
        elif i % 3 == 1:
            assert out.text in choices
        else:   # Python's own parser: only numbers and + - * / with parentheses
            tree = ast.parse(out.text, mode="eval")
            assert all(isinstance(n, (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub,
                                      ast.Mult, ast.Div)) for n in ast.walk(tree)), out.text


def test_regex_classes_are_ascii(llm):
    """`\\d` and `\\w` read as a JSON schema's pattern reads them: under the Rust regex crate's
    Unicode classes this prompt's greedy answer was '🯸🯸🯸-🯸🯸🯸🯸' (U+1FBF8 is a Unicode digit)."""
    p = llm.apply_chat_template([{"role": "user", "content": "What is your phone number?"}])
    regex = r"\d{3}-\d{4} \w{2,6}"
    outs = llm.generate([p] * 4, [params(GrammarSpec.regex(regex), s > 0, seed=s, max_new=40)
                                  for s in range(4)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert re.fullmatch(regex, out.text, re.ASCII), out.text
    backend = llm.core.grammars
    spec = GrammarSpec.regex(r"[\d]\w")
    for text, ok in (("7a", True), ("٣a", False), ("7é", False)):
        state = backend.new_state(backend.compiled(spec), spec)
        assert state.accept(llm.tokenizer.encode(text, add_special_tokens=False)) == ok, text


def test_unconstrained_rows_are_untouched(llm):
    plain = [llm.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                     "Once upon a time")]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(plain, [greedy, sampled, greedy])]
    constrained = [llm.apply_chat_template(prompt(w)) for w, _ in SCHEMAS[:5]]
    mixed = llm.generate(constrained[:3] + plain + constrained[3:],
                         [params(GrammarSpec.json_schema(s), True, i) for i, (_, s)
                          in enumerate(SCHEMAS[:3])] + [greedy, sampled, greedy]
                         + [params(GrammarSpec.json_schema(s), False) for _, s in SCHEMAS[3:5]])
    assert [o.token_ids for o in mixed[3:6]] == alone
    for (_, schema), out in zip(SCHEMAS[:3] + SCHEMAS[3:5], mixed[:3] + mixed[6:]):
        jsonschema.validate(json.loads(out.text), schema)


def test_finished_grammar_allows_only_eos(llm):
    backend = llm.core.grammars
    state = backend.new_state(backend.compiled(GrammarSpec.choice(["yes"])),
                              GrammarSpec.choice(["yes"]))
    assert state.accept(llm.tokenizer.encode("yes", add_special_tokens=False))
    bits = np.unpackbits(backend.fill_masks([state])[0].view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [llm.tokenizer.eos_token_id]
    # The output stops at EOS even though max_new_tokens leaves room.
    out = llm.generate([llm.encode("Answer:")], params(GrammarSpec.choice(["yes"]), False))[0]
    assert (out.text, out.finish_reason) == ("yes", "stop")


def test_a_refused_sampled_token_is_a_server_fault(llm, monkeypatch):
    """With masks switched off the model writes what the grammar refuses: a fault of the
    server, not of the request (finish_reason "error", counted in grammar_faults); its pages go
    back (checked by the fixture) and its neighbour is untouched."""
    backend = llm.core.grammars
    monkeypatch.setattr(backend, "fill_masks", lambda states: np.full(
        (len(states), backend.words), 0xFFFFFFFF, np.uint32))
    spec = GrammarSpec.regex("[0-9]{30}")
    other = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = llm.stats().grammar_faults
    outs = llm.generate([llm.encode("Once upon a time"), llm.encode("Hello")],
                        [params(spec, False), other])
    assert outs[0].finish_reason == "error" and "server fault" in outs[0].error
    assert llm.stats().grammar_faults == before + 1
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8


def test_a_grammar_with_no_next_token_is_the_requests_error(llm, monkeypatch):
    """A mask that allows nothing (no output can go on) ends the request with
    "grammar_error", which the server answers with a 400 naming the grammar's field."""
    backend = llm.core.grammars
    monkeypatch.setattr(backend, "fill_masks", lambda states: np.zeros(
        (len(states), backend.words), np.uint32))
    spec = GrammarSpec.regex("[0-9]{30}")
    other = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = llm.stats().grammar_faults
    outs = llm.generate([llm.encode("Once upon a time"), llm.encode("Hello")],
                        [params(spec, True), other])
    assert outs[0].finish_reason == "grammar_error" and outs[0].token_ids == []
    assert "allows no next token" in outs[0].error
    assert llm.stats().grammar_faults == before
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8


@pytest.mark.parametrize("spec,contains", [
    (GrammarSpec.json_schema({"type": "strin"}, "response_format"), "type"),
    (GrammarSpec.json_schema({"not": {"type": "string"}}, "response_format", strict=True), "not"),
    (GrammarSpec.json_schema({"type": "string", "pattern": "(("}, "response_format"), "regex"),
    (GrammarSpec.regex("(a|b", "guided_regex"), "regex"),
    (GrammarSpec.lark("start: foo", "guided_grammar"), "foo"),
])
def test_bad_grammars_name_the_field(llm, spec, contains):
    with pytest.raises(RequestError, match=contains) as e:
        llm.generate([llm.encode("x")], params(spec, False))
    assert e.value.param == spec.param
    assert llm.generate([llm.encode("x")], SamplingParams(max_new_tokens=2))[0].token_ids


def test_compile_timeout_is_a_request_error(llm, monkeypatch):
    monkeypatch.setattr(llm.core.grammars, "compile_timeout", 0.01)
    big = GrammarSpec.json_schema({"enum": [f"w{i}x{i * 7}" for i in range(40000)]},
                                  "response_format")
    with pytest.raises(RequestError, match="did not compile within") as e:
        llm.generate([llm.encode("x")], params(big, False))
    assert e.value.param == "response_format"


def test_structured_output_off(llm, monkeypatch):
    monkeypatch.setattr(llm.core, "grammars", None)
    with pytest.raises(RequestError, match="structured output is off") as e:
        llm.generate([llm.encode("x")], params(GrammarSpec.json_object("response_format"), False))
    assert e.value.param == "response_format"


def test_compile_cache_and_whitespace(llm):
    backend = llm.core.grammars
    spec = GrammarSpec.json_schema(SCHEMAS[0][1])
    assert backend.compile(spec) is backend.compile(GrammarSpec.json_schema(SCHEMAS[0][1], "x"))
    out = llm.generate([llm.apply_chat_template(prompt("a person"))], params(spec, False))[0]
    assert not re.search(r"\s", out.text.replace(json.loads(out.text)["name"], "")), out.text


def test_generate_flags(tmp_path):
    from maxjax.cli.args import GenerateOptions, grammar_spec
    from maxjax.errors import UserError
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMAS[0][1]))
    assert grammar_spec(GenerateOptions(json_schema=str(f))) == GrammarSpec.json_schema(
        SCHEMAS[0][1])
    assert grammar_spec(GenerateOptions(regex="[0-9]+")) == GrammarSpec.regex("[0-9]+")
    assert grammar_spec(GenerateOptions()) is None
    with pytest.raises(UserError, match="one of"):
        grammar_spec(GenerateOptions(regex="a", grammar=str(f)))
    f.write_text("{not json")
    with pytest.raises(UserError, match="--json-schema"):
        grammar_spec(GenerateOptions(json_schema=str(f)))
