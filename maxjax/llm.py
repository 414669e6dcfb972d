"""The offline Python API: `maxjax.LLM(model=...).generate(prompts, SamplingParams(...))`.

It drives EngineCore synchronously on the calling thread; the server uses AsyncEngine instead.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from maxjax.engine.config import EngineConfig
from maxjax.engine.core import EngineCore
from maxjax.engine.detokenizer import TextStream
from maxjax.engine.types import SamplingParams, TokenLogprob
from maxjax.models.loader import LoadedModel, load_model


@dataclass
class CompletionOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def usage(self) -> dict:
        n, m = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


_ids = itertools.count()


class LLM:
    def __init__(self, model: str | LoadedModel | None = None, *, quantization_encoding: str | None = None,
                 chat_template: str | None = None, custom_architectures=(), progress: bool = False,
                 precompiled_artifacts=None, **engine_options):
        from maxjax.models import registry
        for spec in custom_architectures:
            registry.register_custom(spec)
        if not isinstance(model, LoadedModel):
            stored = None
            if precompiled_artifacts:
                from maxjax.aot import weights as aot_weights
                stored = aot_weights.params_source(precompiled_artifacts)
            model = load_model(model, quantization_encoding, chat_template, progress=progress,
                               params_source=stored)
        self.model = model
        self.tokenizer = model.tokenizer
        self.engine_config = EngineConfig(quantization_encoding=model.dtype, **engine_options)
        layout = None
        if precompiled_artifacts:
            from maxjax.aot import load as aot_load
            layout, executables = aot_load.load_for_engine(precompiled_artifacts, model,
                                                           self.engine_config)
        self.core = EngineCore(model, self.engine_config, layout)
        if precompiled_artifacts:
            self.core.runner.set_executables(executables)
        self.core.warmup()
        self.detokenize_seconds = 0.0

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not self.model.chat_template:
            raise ValueError("this model has no chat template (pass chat_template=...)")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.model.chat_template,
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[CompletionOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists. Requests with a
        `cache_salt` share prefix-cache pages only with requests of the same salt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        outs, streams, pending = {}, {}, []
        try:
            for prompt, p in zip(prompts, params):
                ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = f"llm-{next(_ids)}"
                self.core.add_request(rid, ids, p, cache_salt)
                pending.append(rid)
                outs[rid] = CompletionOutput(prompt if isinstance(prompt, str) else None, ids,
                                             logprobs=[] if p.logprobs else None)
                streams[rid] = (TextStream(self.tokenizer, p, ids) if self.tokenizer else None, p)
            self._run(outs, streams)
        except BaseException:
            for rid in pending:
                self.core.abort(rid)
            raise
        return [outs[rid] for rid in pending]

    def _run(self, outs: dict, streams: dict) -> None:
        live = set(outs)
        while live:
            for ev in self.core.step():
                if ev.request_id not in live:
                    continue
                out = outs[ev.request_id]
                text, p = streams[ev.request_id]
                out.token_ids.append(ev.token_id)
                out.cached_tokens = ev.cached_tokens
                if ev.prompt_logprobs is not None:
                    out.prompt_logprobs = ev.prompt_logprobs
                if ev.logprob is not None:
                    out.logprobs.append(ev.logprob)
                if text is not None and not (ev.finished and ev.token_id in p.stop_token_ids):
                    t0 = time.perf_counter()
                    out.text += text.add([ev.token_id])
                    self.detokenize_seconds += time.perf_counter() - t0
                if text is not None and text.stopped:
                    if not ev.finished:
                        self.core.abort(ev.request_id, "stop")
                    out.finish_reason = "stop"
                elif ev.finished:
                    out.finish_reason = ev.finish_reason
                if out.finish_reason is not None:
                    if text is not None:
                        out.text += text.finish()
                    live.discard(ev.request_id)
            if live and not self.core.has_unfinished():
                raise RuntimeError(f"requests {sorted(live)} vanished from the engine")

    def chat(self, messages, sampling_params=None) -> list[CompletionOutput]:
        """messages: one conversation (list of {role, content}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params)

    def stats(self) -> dict:
        return self.core.stats()

    def profile_report(self) -> str:
        """Where the engine's step time went, per step and as a share of the total."""
        prof = dict(self.core.profile, detokenize=self.detokenize_seconds)
        steps = max(prof.pop("steps"), 1)
        tokens = prof.pop("tokens")
        total = sum(prof.values()) or 1.0
        lines = [f"{steps} steps, {tokens} tokens, {total:.2f} s",
                 "| phase | ms per step | share |", "|---|---|---|"]
        lines += [f"| {k} | {v / steps * 1e3:.2f} | {100 * v / total:.1f}% |" for k, v in prof.items()]
        return "\n".join(lines)
