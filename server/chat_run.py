"""One chat turn, the same under every API that speaks chat (OpenAI chat completions, the
Responses API, Anthropic Messages): a ChatCompletionRequest -> tool setup, prompt (chat template),
SamplingParams and grammar -> Generation -> each choice's text parsed by ChatOutput into typed
parts (server/chat_events.py). A route translates its own request shape into a
ChatCompletionRequest and renders the `ChoiceEvent`s (streamed) or `FinalChoice`s (whole) into its
shapes; nothing here knows which API asked."""
from __future__ import annotations

import time

from maxjax.engine.types import FinishReason, SamplingParams

from .chat_events import ChoiceEvent, FinalChoice, Finish
from .chat_output import ChatOutput
from .chat_prompt import chat_prompt
from .generation import Choice, Generation
from .protocol import APIError, ChatCompletionRequest
from .reasoning import grammar_start
from .sampling_request import CHAT_ERROR_NAMES, default_max_tokens, per_choice, sampling_params
from .state import ServerState
from .structured import unenforced_notes, warning_headers
from .tools import ToolSetup, tool_setup


def _own_spec(params: SamplingParams):
    """The request's own grammar (not a tool call's)."""
    spec = params.structured_output
    return spec if spec is not None and spec.param != "tools" else None


def finish(c: Choice, out: ChatOutput) -> Finish:
    """A cut-off output is LENGTH even when it holds complete calls before the cut."""
    raw = c.finish_reason
    calls = out.tool_calls and raw != FinishReason.LENGTH
    return Finish(FinishReason.TOOL_CALLS if calls else raw, raw)


def chat_constraint(st: ServerState, params: SamplingParams, tools: ToolSetup | None,
                    prompt_text: str):
    """The grammar of a chat request: a tool call's (forced, or triggered by the call's opening
    tag in `auto`), else the request's own, applied after the reasoning block when a reasoning
    parser is on."""
    spec = params.structured_output
    if tools and st.cfg.enable_tool_call_constrained_decode:
        if spec is not None and tools.forced:
            raise APIError(400, f"{spec.param}: cannot be combined with tool_choice "
                                f"{tools.choice!r}", param=spec.param)
        # auto's grammar only where the engine has one (else its calls are parsed unheld)
        if spec is None and (tools.forced or st.engine.info().get("structured_output")):
            spec = tools.grammar(st.engine.tokenizer)
    if spec is not None:
        spec = spec.after(grammar_start(st.reasoning_parser, prompt_text))
    return spec


class ChatTurn:
    """Use `turn = await ChatTurn.prepare(...)`, then `async with turn:`; `events()` streams,
    `collect()` waits for the whole result."""

    def __init__(self, st: ServerState, req: ChatCompletionRequest, rid: str, t0: float,
                 lora: str | None, tools: ToolSetup | None, prompt: list[int], prompt_text: str,
                 params: SamplingParams, images: list | None = None,
                 partial_calls: bool = False):
        self.st, self.req, self.rid, self.t0, self.lora = st, req, rid, t0, lora
        self.partial_calls = partial_calls
        self.images = images or None
        self.tools, self.prompt, self.prompt_text, self.params = tools, prompt, prompt_text, params
        self.created = int(time.time())
        self.gen: Generation | None = None
        self.outputs: dict[int, ChatOutput] = {}
        # What the schemas ask that the grammar does not enforce: for the response's headers.
        self.headers = warning_headers(unenforced_notes(_own_spec(params), tools))

    @classmethod
    async def prepare(cls, st: ServerState, req: ChatCompletionRequest, rid: str, t0: float,
                      lora: str | None = None, clamp: bool = False,
                      partial_calls: bool = False) -> "ChatTurn":
        """Everything that can fail on the request's own fields, before any engine work.
        `clamp`: a max_tokens over what the prompt leaves is cut to it (default_max_tokens);
        `partial_calls`: a call cut off by max_tokens is kept, with the arguments that parse
        (Anthropic's partial tool_use), not dropped."""
        tools = tool_setup(req, st.tool_parser)
        prompt, prompt_text, images = await chat_prompt(st, req, tools)
        max_new = default_max_tokens(st, [prompt], req.max_completion_tokens or req.max_tokens,
                                     clamp=clamp)
        params = sampling_params(st, req, max_new, bool(req.logprobs), req.top_logprobs or 0)
        params.structured_output = chat_constraint(st, params, tools, prompt_text)
        if tools and tools.parser == "mistral":
            params.skip_special_tokens = False      # [TOOL_CALLS] is a special token
        return cls(st, req, rid, t0, lora, tools, prompt, prompt_text, params, images,
                   partial_calls)

    async def __aenter__(self) -> "ChatTurn":
        st, req = self.st, self.req
        self.gen = Generation(st.engine, st.admission, st.metrics, self.rid, [self.prompt], req.n,
                              per_choice(self.params, req.n, req.n), req.cache_salt, self.t0,
                              CHAT_ERROR_NAMES, self.lora, self.images)
        await self.gen.start()
        st.metrics.prompt_tokens.inc(len(self.prompt))
        self.outputs = {c.index: self._parser() for c in self.gen.choices}
        return self

    async def __aexit__(self, *exc) -> None:
        if self.gen is not None:
            await self.gen.close()

    def _parser(self) -> ChatOutput:
        return ChatOutput(self.st.reasoning_parser, self.tools.parser if self.tools else None,
                          self.prompt_text,
                          {f["name"] for f in self.tools.functions} if self.tools else None,
                          self.partial_calls)

    @property
    def choices(self) -> list[Choice]:
        return self.gen.choices

    def _strip_eos(self, text: str) -> str:
        """With special tokens kept in the text (the mistral parser), EOS is not content."""
        eos = getattr(self.st.engine.tokenizer, "eos_token", None)
        mistral = self.tools and self.tools.parser == "mistral"
        return text.replace(eos, "") if mistral and eos and text else text

    async def events(self):
        """Yield a ChoiceEvent per engine output that adds anything; raises APIError."""
        want_lp = bool(self.req.logprobs)
        async for c, out in self.gen.events():
            o = self.outputs[c.index]
            parts = o.feed(self._strip_eos(out.new_text))
            if out.finished:
                parts += o.finish(truncated=c.finish_reason == FinishReason.LENGTH)
            lps = out.new_logprobs if want_lp else None
            if parts or out.finished or lps:
                yield ChoiceEvent(c.index, parts, lps, finish(c, o) if out.finished else None)

    async def collect(self) -> list[FinalChoice]:
        async for _ in self.gen.events():
            pass
        finals = []
        for c in self.gen.choices:
            o = self.outputs[c.index]
            o.feed(self._strip_eos("".join(c.text)))
            o.finish(truncated=c.finish_reason == FinishReason.LENGTH)
            finals.append(FinalChoice(c.index, o.message(), finish(c, o), c.logprobs))
        return finals

    def usage_counts(self) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens."""
        return self.gen.usage_counts()
