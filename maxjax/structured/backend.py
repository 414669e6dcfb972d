"""The grammar engine (llguidance) for one model: its tokenizer view (built once, vocabulary =
the logits' width, the model's EOS ids), grammar compilation off the step loop, token masks.

Compilation runs on a small worker pool (llguidance drops the GIL while it builds a grammar) and
is cached: `compile(spec)` returns a Future of a compiled matcher, the same Future for the same
grammar while it stays in the LRU cache. Callers wait for it with a timeout before the request
reaches the scheduler (the server awaits it on its event loop, maxjax.LLM blocks), so a request
waiting for its grammar holds up no step; an invalid grammar or a timeout is a RequestError
naming the request's field. Each request gets its own copy of the compiled matcher
(`GrammarState`); masks of all constrained rows of a step are filled in one parallel call.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import threading
import time
import weakref
from collections import OrderedDict

import numpy as np

from maxjax.errors import RequestError, UserError
from maxjax.structured.spec import GrammarSpec

BACKENDS = ("llguidance",)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def unenforced(schema: str | dict) -> list[str]:
    """What a JSON schema asks that the grammar does not enforce (llguidance's warnings, e.g.
    'Unimplemented keys: ["uniqueItems"]'), plus oneOf where it is matched as anyOf. Needs no
    tokenizer; an invalid schema gives [] (compiling it reports the error)."""
    return list(_unenforced(schema if isinstance(schema, str) else
                            json.dumps(schema, sort_keys=True)))


@functools.lru_cache(maxsize=256)
def _unenforced(text: str) -> tuple[str, ...]:
    """Cached: the server asks on every request that carries a schema, on its event loop."""
    import llguidance
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
        _, notes = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except ValueError:
        return ()
    if '"oneOf"' in text:
        notes.append("oneOf matched as anyOf")
    return tuple(_one_line(n) for n in notes)


class GrammarState:
    """A request's matcher. `accept` advances it by the tokens a step appended; `mask_needed`
    says whether its next token is constrained (not while the output has not reached
    `start_after`). `validate` / `rollback` are for draft tokens (speculative decoding): how many
    of a draft the grammar allows, and undoing tokens accepted past a rejected draft."""

    def __init__(self, matcher, tokenizer=None, start_after: str | None = None):
        self.matcher = matcher
        self._tokenizer = tokenizer          # decodes tokens while waiting for start_after
        self._start_after = start_after
        self._tail = ""
        self.num_consumed = 0

    @property
    def active(self) -> bool:
        return self._start_after is None

    @property
    def mask_needed(self) -> bool:
        return self.active and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        return _one_line(self.matcher.get_error()) if self.matcher.is_error() else None

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def accept(self, token_ids) -> bool:
        """Consume the tokens; False once the matcher is in error (a token it did not allow)."""
        for i, t in enumerate(token_ids):
            if not self.active:
                tail = self._tail + self._tokenizer.decode([t])
                if self._start_after in tail:
                    self._start_after, self._tail = None, ""
                else:
                    self._tail = tail[-len(self._start_after):]
                continue
            if not self.matcher.consume_token(int(t)):
                return False
            self.num_consumed += 1
        return not self.matcher.is_error()

    def validate(self, draft) -> int:
        """How many leading draft tokens the grammar would accept (nothing is consumed)."""
        return self.matcher.validate_tokens([int(t) for t in draft]) if self.active else len(draft)

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            self.num_consumed -= n


_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()
_LL_BUILDER: list = []


def prepare(tokenizer, vocab_size: int, eos_token_ids) -> concurrent.futures.Future:
    """The Future of `tokenizer`'s llguidance tokenizer, built once a process on a thread of its
    own; data-parallel replicas share it. It holds the GIL while it builds (0.2-0.4 s for a 49k
    vocabulary, ~2 s for Gemma's 262k: other Python threads, the engine's loop among them, wait
    that long), so it is built when the first grammar needs it."""
    import llguidance.hf
    eos = [int(t) for t in eos_token_ids] or [tokenizer.eos_token_id]
    key = (vocab_size, tuple(eos))

    def build():
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                            eos_token=eos[0] if len(eos) == 1 else eos)
    with _LL_LOCK:
        if not _LL_BUILDER:
            _LL_BUILDER.append(concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="maxjax-grammar-tokenizer"))
        try:
            built = _LL_TOKENIZERS.setdefault(tokenizer, {})
        except TypeError:       # not weakly referable: built for this caller alone
            built = {}
        if key not in built:
            built[key] = _LL_BUILDER[0].submit(build)
        return built[key]


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *, any_whitespace: bool = False,
                 compile_timeout: float = 10.0, cache_size: int = 256, workers: int = 2):
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        self._llg = llguidance
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self.compile_timeout = compile_timeout
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(workers,
                                                           thread_name_prefix="maxjax-grammar")
        self._eos_token_ids = eos_token_ids
        self._tokenizer: concurrent.futures.Future | None = None
        self._executor = llguidance.LLExecutor()
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []    # per grammar compiled (benchmarks)

    def prepare(self) -> concurrent.futures.Future:
        """llguidance's tokenizer, built on the first grammar's compile (`prepare`): it holds
        the GIL while it builds, so a start does not, and neither does a server that never
        gets a structured-output request."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = prepare(self.hf_tokenizer, self.vocab_size, self._eos_token_ids)
            return self._tokenizer

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    # ---- compilation --------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """The Future of the compiled matcher (a template: copy it per request)."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _grammar(self, spec: GrammarSpec) -> str:
        llg = self._llg
        if spec.kind in ("json_schema", "json_object"):
            ws = ({} if self.any_whitespace else
                  {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
            return llg.LLMatcher.grammar_from_json_schema(spec.source, defaults=ws)
        if spec.kind == "regex":
            # read as a JSON schema's `pattern` is: \d and \w ASCII (the Rust regex crate's
            # are Unicode, and `\d` took U+1FBF8 SEGMENTED DIGIT EIGHT for a digit)
            return llg.LLMatcher.grammar_from_lark(
                f"start: /{llg.regex_to_lark(spec.source, use_ascii='dw')}/")
        if spec.kind == "choice":
            return llg.grammar_from("choice", spec.source)
        if spec.kind == "lark":
            # A grammar with `::=` rules is GBNF/EBNF; llguidance converts it to Lark.
            return llg.grammar_from("grammar" if "::=" in spec.source else "lark", spec.source)
        raise RequestError(spec.param, f"unknown grammar kind {spec.kind!r}")

    def _compile(self, spec: GrammarSpec):
        t0 = time.perf_counter()
        try:
            grammar = self._grammar(spec)
        except ValueError as e:
            raise RequestError(spec.param, f"invalid grammar: {_one_line(e)}") from None
        matcher = self._llg.LLMatcher(self.prepare().result(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(spec.param, f"cannot compile: {_one_line(matcher.get_error())}")
        self.compile_seconds.append(time.perf_counter() - t0)
        return matcher

    def _timeout(self, spec: GrammarSpec) -> RequestError:
        return RequestError(spec.param, f"the grammar did not compile within "
                                        f"{self.compile_timeout:g} s")

    def compiled(self, spec: GrammarSpec):
        """Block until the grammar is compiled (maxjax.LLM)."""
        try:
            return self.compile(spec).result(self.compile_timeout)
        except concurrent.futures.TimeoutError:
            raise self._timeout(spec) from None

    async def compiled_async(self, spec: GrammarSpec):
        """Wait for the grammar on an event loop (the server), without blocking it."""
        fut = asyncio.wrap_future(self.compile(spec))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.compile_timeout)
        except asyncio.TimeoutError:
            raise self._timeout(spec) from None

    # ---- per request --------------------------------------------------------------------------
    def new_state(self, compiled, spec: GrammarSpec) -> GrammarState:
        return GrammarState(compiled.deep_copy(), self.hf_tokenizer, spec.start_after)

    def fill_masks(self, states: list[GrammarState]) -> np.ndarray:
        """u32[len(states), ceil(V/32)] allow-bits of each state's next token."""
        mask = np.full((len(states), self.words), -1, np.int32)
        if len(states) == 1:
            self._llg.numpy.fill_next_token_bitmask(states[0].matcher, mask, 0)
        elif states:
            self._llg.numpy.fill_next_token_bitmask_par(
                self._executor, [(s.matcher, i) for i, s in enumerate(states)], mask)
        return mask.view(np.uint32)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def backend_for(cfg, model) -> GrammarBackend | None:
    """The engine's grammar backend from its config (None: structured output off, or a model
    without a tokenizer); a UserError for an unknown backend name."""
    check_flags(cfg)
    if not cfg.enable_structured_output or model.tokenizer is None:
        return None
    return GrammarBackend(model.tokenizer, model.config.vocab_size, model.config.eos_token_ids,
                          any_whitespace=cfg.structured_output_any_whitespace,
                          compile_timeout=cfg.structured_output_compile_timeout)


def check_flags(cfg) -> None:
    """The structured-output flags (maxjax/engine/plan.py's check_flags runs it with the rest,
    before anything loads)."""
    if cfg.structured_output_backend not in BACKENDS:
        why = (" (xgrammar imports torch and pulls triton at import time, which a JAX server "
               "does not install; llguidance enforces the same JSON schemas, regexes and "
               "grammars)" if cfg.structured_output_backend == "xgrammar" else "")
        raise UserError(f"--structured-output-backend {cfg.structured_output_backend}: not "
                        f"supported{why}; supported: {', '.join(BACKENDS)}")
    if cfg.structured_output_compile_timeout <= 0:
        raise UserError("--structured-output-compile-timeout must be > 0")
