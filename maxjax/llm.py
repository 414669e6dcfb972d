"""The offline Python API: `maxjax.LLM(model=...).generate(prompts, SamplingParams(...))`.

It drives EngineCore synchronously on the calling thread (the server uses AsyncEngine instead)
and gathers each request's RequestOutputs into one CompletionOutput; `embed` returns the pooled
embeddings of prompts through the same engine.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass, field

from maxjax.engine import speculative
from maxjax.engine.build import build_core
from maxjax.engine.config import EngineConfig
from maxjax.engine.stats import EngineStats
from maxjax.engine.types import FinishReason, PoolingParams, SamplingParams, TokenLogprob
from maxjax.errors import RequestError, UserError
from maxjax.models.loader import LoadedModel
from maxjax.models.source import ModelSource


@dataclass
class CompletionOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None          # with finish_reason "error": what failed

    @property
    def usage(self) -> dict:
        n, m = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


_ids = itertools.count()


class LLM:
    def __init__(self, model: str | ModelSource | LoadedModel | None = None, *,
                 quantization_encoding: str | None = None,
                 chat_template: str | None = None, custom_architectures=(), progress: bool = False,
                 precompiled_artifacts=(), require_compiled_artifacts: bool = False,
                 compile_cache: bool | None = None, compile_cache_max_size: str | None = None,
                 **engine_options):
        from maxjax import cache_home, transformers_index
        from maxjax.models import registry
        cache_home.check(compile_cache)
        transformers_index.install(compile_cache)
        for spec in custom_architectures:
            registry.register_custom(spec)
        self.flags = EngineConfig(quantization_encoding=quantization_encoding, **engine_options)
        if precompiled_artifacts and not isinstance(model, LoadedModel):
            from maxjax.aot.load import adopt_chat_template, adopt_flags
            chat_template = adopt_chat_template(precompiled_artifacts, chat_template)
            if isinstance(model, ModelSource):
                path, self.flags = adopt_flags(precompiled_artifacts, model.model_path, self.flags)
                model = dataclasses.replace(model, model_path=path)
            else:
                model, self.flags = adopt_flags(precompiled_artifacts, model, self.flags)
        from maxjax.engine import devices      # cpu:N: JAX starts with N host devices
        devices.select_platform(self.flags.devices, draft=self.flags.draft_devices)
        if self.flags.data_parallel_degree != 1:
            raise UserError("--data-parallel-degree: replicas run behind `maxjax serve`; the "
                            "offline API runs one engine (use --devices for tensor parallelism)")
        self.core = build_core(model, self.flags, chat_template=chat_template,
                               precompiled_artifacts=precompiled_artifacts or (),
                               require_compiled=require_compiled_artifacts, progress=progress,
                               compile_cache=compile_cache,
                               compile_cache_max_size=compile_cache_max_size)
        self.model = self.core.model
        self.tokenizer = self.model.tokenizer
        # One caller at a time drives the engine: a second thread's steps would take (and
        # drop) the first one's outputs.
        self._lock = threading.RLock()

    @property
    def engine_config(self) -> EngineConfig:
        """The settings the engine runs with: the plan's (maxjax/engine/plan.py)."""
        return self.core.cfg

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        defaults (maxjax/models/sampling_defaults.py, under generation_config=; vLLM's method).
        A SamplingParams passed in is taken as it is."""
        return self.model.sampling_defaults.params()

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """A conversation's prompt token ids. A RequestError names the message at fault, or
        says what the template refused."""
        import jinja2
        if not self.model.chat_template:
            raise ValueError("this model has no chat template (pass chat_template=...)")
        try:
            return self.tokenizer.apply_chat_template(
                _template_messages(messages), chat_template=self.model.chat_template,
                add_generation_prompt=True, tokenize=True, return_dict=False)
        except (jinja2.TemplateError, TypeError, KeyError) as e:
            raise RequestError("messages", f"the chat template rejected them: {e}") from None

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None,
                 lora: str | list[str | None] | None = None) -> list[CompletionOutput]:
        """prompts: one prompt or a list: strings, token-id lists, or vLLM's {"prompt": text}
        / {"prompt_token_ids": ids}. Calls from several threads take turns. Requests with a
        `cache_salt` share prefix-cache pages only with requests of the same salt. `lora`: the
        LoRA adapter (a name from lora_paths or `load_lora`) of every prompt, or one per prompt
        (None: the base model)."""
        prompts = _prompt_list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        loras = lora if isinstance(lora, list) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora names for {len(prompts)} prompts")
        with self._lock:
            return self._generate(prompts, params, loras, cache_salt)

    def _generate(self, prompts, params, loras, cache_salt) -> list[CompletionOutput]:
        outs, pending = {}, []
        try:
            for i, (prompt, p, name) in enumerate(zip(prompts, params, loras)):
                prompt, ids = self._prompt_ids(prompt, i)
                rid = f"llm-{next(_ids)}"
                self.core.add_request(rid, ids, p, cache_salt, lora=name)
                pending.append(rid)
                outs[rid] = CompletionOutput(prompt, ids, logprobs=[] if p.logprobs else None)
            self._run(outs)
        except BaseException:
            for rid in pending:
                self.core.abort(rid)
            raise
        return [outs[rid] for rid in pending]

    def embed(self, prompts, pooling_type: str | None = None,
              normalize: bool = True) -> list[list[float]]:
        """One embedding per prompt (a string, a list of strings or of token-id lists): the
        final hidden states pooled by `pooling_type` ("last" or "mean"; None: the engine's
        --pooling-type) and L2-normalized unless `normalize` is off."""
        prompts = _prompt_list(prompts)
        pooling = self.core.default_pooling(pooling_type)
        if not normalize:
            pooling = PoolingParams(pooling.pooling_type, normalize=False)
        with self._lock:
            return self._embed(prompts, pooling)

    def _embed(self, prompts, pooling) -> list[list[float]]:
        vectors, pending = {}, []
        try:
            for i, prompt in enumerate(prompts):
                ids = self._prompt_ids(prompt, i)[1]
                rid = f"llm-{next(_ids)}"
                self.core.add_embedding(rid, ids, pooling)
                pending.append(rid)
            live = set(pending)
            while live:
                for out in self.core.step():
                    if out.request_id in live and out.finished:
                        if out.embedding is None:
                            raise RuntimeError(f"embedding {out.request_id} failed: {out.error}")
                        vectors[out.request_id] = out.embedding
                        live.discard(out.request_id)
                if live and not self.core.has_unfinished():
                    raise RuntimeError(f"requests {sorted(live)} vanished from the engine")
        except BaseException:
            for rid in pending:
                self.core.abort(rid)
            raise
        return [vectors[rid] for rid in pending]

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in `path` as `name` (needs enable_lora=True); compiles nothing."""
        with self._lock:
            self.core.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        with self._lock:
            self.core.unload_lora(name)

    def _prompt_ids(self, prompt, i: int) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids): a string, a list of token ids, or
        vLLM's {"prompt": text} / {"prompt_token_ids": ids}."""
        if isinstance(prompt, dict) and len(prompt) == 1:
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids", prompt))
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise RequestError(f"prompts[{i}]", "must be a string, a list of token ids, "
                                            "{'prompt': str} or {'prompt_token_ids': [int]}")

    def _run(self, outs: dict) -> None:
        live = set(outs)
        while live:
            for out in self.core.step():
                if out.request_id not in live:
                    continue
                c = outs[out.request_id]
                c.token_ids += out.new_token_ids
                c.text += out.new_text
                c.cached_tokens = out.cached_tokens
                if out.new_logprobs:
                    c.logprobs += out.new_logprobs
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.finish_reason, c.error = out.finish_reason, out.error
                    live.discard(out.request_id)
            if live and not self.core.has_unfinished():
                raise RuntimeError(f"requests {sorted(live)} vanished from the engine")

    def chat(self, messages, sampling_params=None) -> list[CompletionOutput]:
        """messages: one conversation (list of {role, content}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params)


    def stats(self) -> EngineStats:
        return self.core.stats()

    def profile_report(self) -> str:
        """Where the engine's step time went, per step and as a share of the total."""
        prof = dict(self.core.profile)
        steps = max(prof.pop("steps"), 1)
        tokens = prof.pop("tokens")
        total = sum(prof.values()) or 1.0
        lines = [f"{steps} steps, {tokens} tokens, {total:.2f} s",
                 "| phase | ms per step | share |", "|---|---|---|"]
        lines += [f"| {k} | {v / steps * 1e3:.2f} | {100 * v / total:.1f}% |" for k, v in prof.items()]
        spec = speculative.report(self.core.stats().spec)
        return "\n".join(lines + ([spec] if spec else []))


def _prompt_list(prompts) -> list:
    """One prompt (a string, a list of token ids, a dict) as a list of one."""
    one = isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int))
    return [prompts] if one else list(prompts)


def _template_messages(messages) -> list[dict]:
    """A conversation as a chat template reads it: each message a dict with a role, its
    content a string (OpenAI's text parts joined, as the server joins them)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages", "must be a non-empty list of {role, content} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]", "must be a dict with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError(f"messages[{i}].content", "parts must be "
                                                             "{'type': 'text', 'text': str}")
            content = "\n".join(p["text"] for p in content)
        if content is None and m["role"] != "assistant" or \
                content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content", f"a string is required for role "
                                                         f"{m['role']!r}")
        out.append({**m, "content": content if content is not None else ""})
    return out
