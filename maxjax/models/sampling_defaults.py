"""A model's sampling defaults: what a request that leaves out `temperature`, `top_p`, `top_k`,
`min_p` or `repetition_penalty` is sampled with, chosen by --generation-config (vLLM's flag):
- `auto` (the default): the model's own. An HF checkpoint's generation_config.json, the fields it
  sets (as vLLM's `auto`; `do_sample` is ignored there too); a GGUF's `general.sampling.*`
  metadata (llama.cpp's converter writes them from generation_config.json) over llama.cpp's
  server defaults; the embedded SmolLM2 its model card's over llama.cpp's.
- `vllm`: none, OpenAI's raw defaults (temperature 1, no top-k, top-p or min-p).
- a directory: its generation_config.json, whatever the model.
`SamplingDefaults.params` is the one place a request becomes SamplingParams with them
(server/sampling_request.py, maxjax.LLM); a request's own values always win.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from maxjax.engine.types import SamplingParams, param_specs
from maxjax.errors import UserError

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CHOICES = ("auto", "vllm")
# llama.cpp's server (common/common.h: common_params_sampling) for any GGUF
LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# The embedded SmolLM2-135M-Instruct: its model card samples with temperature 0.2 and top_p 0.9
# (its generation_config.json sets none), with llama.cpp's min_p. No top_k: at T 0.2 min_p 0.05
# keeps tokens within 0.6 nats of the top one, which top_k 40 seldom cuts further, and a request
# that sets temperature 1, top_p 1 and min_p 0 then gets the raw distribution.
EMBEDDED = {"temperature": 0.2, "top_p": 0.9, "min_p": 0.05}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
RAW = "OpenAI's defaults"


@dataclass(frozen=True)
class SamplingDefaults:
    """`values`: the fields whose default is not SamplingParams' own; `source`: where they came
    from, in words (what /v1/models and `maxjax suggest` show)."""
    values: dict = field(default_factory=dict)
    source: str = RAW

    def params(self, **given) -> SamplingParams:
        """SamplingParams of the `given` fields (None: left out, takes the default)."""
        return SamplingParams(**{**self.values,
                                 **{k: v for k, v in given.items() if v is not None}})

    def over(self, **values) -> SamplingDefaults:
        """These with `values` (None: not set) put over them: the server's --temperature and
        --top-k, which are named as the fields (a top_k of -1 is off, 0)."""
        given = {k: max(v, 0) if k == "top_k" else v for k, v in values.items() if v is not None}
        if not given:
            return self
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        return SamplingDefaults({**self.values, **given}, f"{flags} over {self.source}")

    def in_force(self) -> dict:
        """Every field's default, and `source`."""
        raw = SamplingParams()
        return {**{f: self.values.get(f, getattr(raw, f)) for f in FIELDS},
                "source": self.source}


def describe(in_force: dict) -> str:
    """`SamplingDefaults.in_force()` in one line (the start-up log, `maxjax suggest`)."""
    shown = {k: v for k, v in in_force.items() if k != "source"}
    return f"{' '.join(f'{k} {v:g}' for k, v in shown.items())} ({in_force['source']})"


def read(path: str | None, choice: str = "auto", penalties: bool = True) -> SamplingDefaults:
    """The defaults of the model whose config is at `path` (a GGUF file or an HF directory;
    maxjax/models/loader.py LoadedModel.source) under --generation-config `choice`. Without
    `penalties` (--no-enable-penalties) a repetition_penalty default is dropped: the engine
    refuses every request that has one."""
    found = _read(path, choice)
    if penalties or "repetition_penalty" not in found.values:
        return found
    values = {k: v for k, v in found.values.items() if k != "repetition_penalty"}
    return SamplingDefaults(values, f"{found.source}, less its repetition_penalty "
                                    "(--no-enable-penalties)")


def _read(path: str | None, choice: str) -> SamplingDefaults:
    if choice == "vllm":
        return SamplingDefaults(source=f"{RAW} (--generation-config vllm)")
    if choice != "auto":
        gen = os.path.join(choice, "generation_config.json")
        if not os.path.isfile(gen):
            raise UserError(f"--generation-config {choice}: give auto, vllm or a directory "
                            "holding a generation_config.json")
        return _generation_config(gen)
    if path and os.path.isfile(path):
        return _gguf(path)
    gen = os.path.join(path or "", "generation_config.json")
    if path and os.path.isfile(gen):
        return _generation_config(gen)
    return SamplingDefaults(source=f"{RAW} (no generation_config.json)")


def _generation_config(gen: str) -> SamplingDefaults:
    try:
        with open(gen) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{gen}: unreadable generation_config.json: {e}") from e
    if not isinstance(data, dict):
        raise UserError(f"{gen}: not a JSON object")
    values = _checked({f: (f, data.get(f)) for f in FIELDS}, gen)
    return SamplingDefaults(values, gen if values else f"{RAW} ({gen} sets none)")


def _gguf(path: str) -> SamplingDefaults:
    from maxjax.models.gguf import GGUFFile
    meta = GGUFFile(path).metadata
    own = _checked({f: (k, meta.get(k)) for k, f in GGUF_KEYS.items()}, path)
    base, source = LLAMA_CPP, "llama.cpp's server defaults"
    if _is_embedded(path):
        base, source = EMBEDDED, "SmolLM2-135M-Instruct's model card, llama.cpp's min_p"
    if own:
        source = f"the GGUF's general.sampling.* over {source}"
    return SamplingDefaults({**base, **own}, source)


def _is_embedded(path: str) -> bool:
    from maxjax.models.source import embedded_model_path
    try:
        return os.path.samefile(path, embedded_model_path())
    except (UserError, OSError):
        return False


def _checked(found: dict, where: str) -> dict:
    """{field: value} of `found` (field -> (the key it was read from, its value or None)), each
    checked against its SamplingParams bounds; a value out of them is a UserError naming the
    key."""
    specs, out = param_specs(), {}
    for name, (key, v) in found.items():
        if v is None:
            continue
        spec = specs[name]
        if name == "top_k" and v == spec.api_off:       # -1: off, as vLLM takes it
            v = 0
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not number or not spec.in_bounds(v) or (name == "top_k" and v != int(v)):
            raise UserError(f"{where}: {key} {v!r} is not a {name} maxjax can sample with "
                            f"({'an integer ' if name == 'top_k' else 'a number '}"
                            f"{spec.bounds_text()})")
        # a GGUF's float32 0.95 reads as 0.949999988079071
        out[name] = int(v) if name == "top_k" else float(f"{float(v):.7g}")
    return out
