"""Host-side incremental detokenization and stop strings, one object per request.

The engine's OutputProcessor (maxjax/engine/output.py) keeps one `TextStream` on each Request, on
the engine's thread; the pieces also work alone:
  - `IncrementalDetokenizer`: token ids -> new text. Decoding one token alone is wrong for both
    byte-level BPE (a character's UTF-8 bytes span tokens) and sentencepiece (a leading "▁" becomes a
    space only after other text), so each step decodes a short window of already-emitted tokens
    (`prefix`) with and without the new ones and emits the difference. A result ending in U+FFFD is an
    incomplete character: nothing is emitted until a later token completes it (or `flush` at the end).
  - `StopChecker`: finds the earliest stop string in the text, cuts the output just before it (OpenAI
    excludes the stop string) and, while streaming, holds back the last max(len(stop)) - 1 characters
    so a stop string split across tokens is never partially emitted. With `min_tokens`, stop
    strings are looked for only once that many tokens came (vLLM's rule), in the text from then on.
"""
from __future__ import annotations

from typing import Sequence

from maxjax.engine.types import SamplingParams

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5   # prompt tokens decoded before the first output token, for its leading space


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_start = 0              # window start: tokens before it are never decoded again
        self._emitted_end = len(self._ids)  # tokens before it have had their text emitted
        self.text = ""                      # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip,
                                      clean_up_tokenization_spaces=False)

    def _delta(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_start:self._emitted_end])
        full = self._decode(self._ids[self._prefix_start:])
        if not final and (full.endswith(_REPLACEMENT) or len(full) <= len(prefix)):
            return ""                       # incomplete character (or nothing visible yet): hold
        if full.startswith(prefix):
            delta = full[len(prefix):]
        else:                               # a tokenizer that rewrites earlier text: emit past the common part
            common = 0
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            delta = full[common:]
        self._prefix_start, self._emitted_end = self._emitted_end, len(self._ids)
        self.text += delta
        return delta

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated token ids; return the text that became final."""
        self._ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is held back, incomplete characters included."""
        if self._emitted_end == len(self._ids):
            return ""
        return self._delta(final=True)


class StopChecker:
    def __init__(self, stop: Sequence[str]):
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""                  # received, not yet emitted (at most _hold characters)
        self.matched: str | None = None     # the stop string found, once stopped

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str, active: bool = True) -> str:
        """New text in; the part safe to emit out. After a stop, everything else is dropped.
        Not `active` (min_tokens not reached yet): all of it out, nothing searched."""
        if self.stopped:
            return ""
        if not active:
            out, self._pending = self._pending + delta, ""
            return out
        # a stop string starting in already emitted text would have ended inside the held tail and
        # been found earlier, so searching the held tail plus the new text is enough
        buf = self._pending + delta
        best = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.matched, self._pending = best[1], ""
            return buf[:best[0]]
        # hold only the longest tail that could still grow into a stop string
        keep = 0
        for n in range(min(self._hold, len(buf)), 0, -1):
            if any(st.startswith(buf[-n:]) for st in self._stops):
                keep = n
                break
        cut = len(buf) - keep
        self._pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        """At the end of the request (length, EOS): release the held tail."""
        out, self._pending = self._pending, ""
        return out


class TextStream:
    """One request's output text: detokenize, then check stop strings. `add` returns what may be
    streamed now; `stopped` tells the caller to finish the request with finish_reason "stop"."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_ids: Sequence[int] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.stop = StopChecker(params.stop)
        self.min_tokens, self.tokens = params.min_tokens, 0
        self.text = ""
        self._held: list[tuple[int, object]] = []     # (token's text offset, its logprob)
        self._ended = False

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def add(self, token_ids: Sequence[int], logprobs: Sequence | None = None) -> str:
        """`logprobs`: the tokens' own, held until their text is emitted (`take_logprobs`)."""
        if logprobs:
            start = len(self.detokenizer.text)
            self._held += [(start, lp) for lp in logprobs]
        self.tokens += len(token_ids)
        out = self.stop.feed(self.detokenizer.add(token_ids), self.tokens >= self.min_tokens)
        self.text += out
        return out

    def finish(self) -> str:
        """The remaining text once the request ended for any reason."""
        out = self.stop.feed(self.detokenizer.flush(), self.tokens >= self.min_tokens)
        if not self.stop.stopped:
            out += self.stop.flush()
        self.text += out
        self._ended = True
        return out

    def take_logprobs(self) -> list:
        """The held logprobs whose tokens' text has been emitted, in order: so the logprobs a
        caller sees are those of the text it got. The tokens of a matched stop string (and of
        what its cut leaves out) get none: their text is not in the output."""
        emitted = len(self.text)
        n = 0
        while n < len(self._held) and (self._held[n][0] < emitted or
                                       self._ended and not self.stopped):
            n += 1
        out = [lp for _, lp in self._held[:n]]
        self._held = [] if self.stopped else self._held[n:]
        return out
