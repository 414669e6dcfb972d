"""Structured output: grammars (JSON schema, regex, choice, Lark) that constrain sampling.

spec.py declares what a request asks for (`GrammarSpec`, no dependency); backend.py owns the
grammar engine (llguidance): the tokenizer built once, compilation on a worker thread with a
timeout and an LRU cache, and the per-request `GrammarState` (matcher, token masks)."""
from maxjax.structured.spec import GrammarSpec  # noqa: F401
