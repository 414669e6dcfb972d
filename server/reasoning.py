"""Reasoning parsers (`--reasoning-parser qwen3 | deepseek_r1 | none`): the text a thinking model
writes inside <think>...</think> goes to the message's reasoning field, the rest to its content,
streamed as deltas (a partial marker is held back, never sent as either).

qwen3: reasoning only when the output opens with <think> (or the prompt left a block open);
deepseek_r1: the output starts inside the block (its template opens it), up to </think>.
`grammar_start` says whether a grammar (response_format, a forced tool call) must wait for the
end of the block: not when the prompt already closed it (e.g. Qwen3 with enable_thinking off).
"""
from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def prompt_state(prompt_text: str) -> tuple[bool, bool]:
    """(the prompt leaves a think block open, the prompt closed one at its end)."""
    tail = prompt_text.rstrip()
    return tail.endswith(START), tail.endswith(END)


def grammar_start(parser: str | None, prompt_text: str) -> str | None:
    """The marker after which a grammar applies; None: from the first token."""
    if parser is None:
        return None
    return None if prompt_state(prompt_text)[1] else END


class ReasoningStream:
    """feed(text) -> (reasoning, content) new since the last call; finish() the rest."""

    def __init__(self, parser: str, prompt_text: str = ""):
        opened, _ = prompt_state(prompt_text)
        # The output may open with <think> even when the block is already open (deepseek_r1).
        self.state = "start"
        self._no_start = "reasoning" if (opened or parser == "deepseek_r1") else "content"
        self.buf = ""
        self._after_end = False

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf, self.state = stripped[len(START):], "reasoning"
                    continue
                if not final and START.startswith(stripped):
                    return reasoning, content          # may still open a block
                self.state = self._no_start
            if self.state == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state, self._after_end = self.buf[i + len(END):], "content", True
                    continue
                keep = 0 if final else _held(self.buf, END)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            if self._after_end:                  # the newlines a model writes after </think>
                self.buf = self.buf.lstrip("\n")
                if not self.buf and not final:
                    return reasoning, content
                self._after_end = False
            content += self.buf
            self.buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)
