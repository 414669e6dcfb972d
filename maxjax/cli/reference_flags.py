"""`max serve` flags that maxjax parses but does not serve beyond their default.

Every flag of `max serve` (docs/reference/max-serve-flags.txt) parses here, so an existing
command line or config file reaches a clear answer instead of argparse's `unrecognized
arguments`. Most are fields of the config dataclasses and do what the reference says. The ones
below name capabilities maxjax does not have (Cascade, diffusion, vision, MoE, MAX's graph
compiler switches, disaggregated serving): each accepts the values that describe what maxjax
does, and any other value is a one-line start-up error naming the flag and why
(tests/test_flag_walk.py walks the whole reference).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from maxjax.errors import UserError


@dataclass(frozen=True)
class Refused:
    name: str
    why: str
    kind: type = bool            # bool: `--x/--no-x`, else the value's type
    accept: tuple = (None, False)   # values that describe what maxjax does (None: not given)
    choices: tuple | None = None


_COMPILER = "XLA compiles each step graph whole before the server is ready"
_CASCADE = "the Cascade server is MAX's; maxjax serves with one API server and engine"
_DIFFUSION = "maxjax serves text models; it has no diffusion pipeline"
_VISION = ("maxjax's vision-language models take their vision settings from the checkpoint "
           "and keep no preprocessing cache")
_MOE = ("maxjax's mixture-of-experts models shard their experts with the rest of the model "
        "(--devices); there is no expert parallelism of its own")
_DISAGG = ("maxjax runs prefill and decode in one engine; it has no disaggregated "
           "prefill/decode workers")
_DRAFT = "the draft model reads the target's token ids and is never served itself"

REFUSED = [
    Refused("allow-cold-interpreter-cache", f"maxjax has no eager interpreter: {_COMPILER}"),
    Refused("cascade", _CASCADE),
    Refused("cascade-local-cpu-workers", _CASCADE, int, (None,)),
    Refused("cascade-local-gpu-workers", _CASCADE, int, (None,)),
    Refused("cascade-remote-cpu-workers", _CASCADE, str, (None,)),
    Refused("cascade-remote-gpu-workers", _CASCADE, str, (None,)),
    Refused("cascade-transport", _CASCADE, str, (None,), ("http", "grpc")),
    Refused("debug-verify-replay", f"maxjax has no device-graph capture and replay: {_COMPILER}"),
    Refused("decode-request-ttl-s", _DISAGG, float, (None,)),
    Refused("decode-stall-timeout-s", _DISAGG, float, (None,)),
    Refused("device-graph-capture", f"maxjax has no device-graph capture and replay: {_COMPILER} "
            "and runs it as one executable"),
    Refused("dp-ce-balance-enable-dynamic-chunk-size", "only consulted with "
            "--dp-ce-balance-timeout-ms > 0, which maxjax does not have"),
    Refused("dp-ce-balance-threshold", "only consulted with --dp-ce-balance-timeout-ms > 0, "
            "which maxjax does not have", float, (None,)),
    Refused("dp-ce-balance-timeout-ms", "requests bind to a replica on arrival (the one caching "
            "their longest prefix, else the least loaded)", int, (None, -1)),
    Refused("draft-chat-template", _DRAFT, str, (None,)),
    Refused("draft-config-file", "give the draft's flags (--draft-*) on the command line or in "
            "--config-file", str, (None,)),
    Refused("draft-data-parallel-degree", "the draft model runs beside each target replica", int, (None, 1)),
    Refused("draft-enable-echo", _DRAFT),
    Refused("draft-pool-embeddings", _DRAFT),
    Refused("draft-section-name", "maxjax reads no config-file sections", str, (None,)),
    Refused("draft-served-model-name", _DRAFT, str, (None,)),
    Refused("draft-use-subgraphs", "maxjax unrolls the layer loop (see --use-subgraphs)",
            bool, (None, False)),
    Refused("draft-vision-config-overrides", _VISION, str, (None,)),
    Refused("eager-usage-validator", "maxjax checks its configuration at start-up only",
            str, (None, "init-only"), ("enabled", "disabled", "init-only")),
    Refused("enable-dp-cross-replica-prefix-copy", "replicas do not copy pages between each "
            "other; a request goes to the replica caching its longest prefix instead"),
    Refused("enable-variable-logits", "always on: a step samples any number of positions per "
            "row (echo, speculative decoding) without another mode", bool, (None, True)),
    Refused("ep-fuse-ffn-combine-send", _MOE),
    Refused("ep-use-allreduce", _MOE),
    Refused("eplb-profile", _MOE),
    Refused("eplb-replicas-per-gpu", _MOE, int, (None, 0)),
    Refused("eplb-stats", _MOE, str, (None,)),
    Refused("execute-empty-batches", _MOE + "; an empty step is never run"),
    Refused("experimental-device-graph-synthesis", _COMPILER),
    Refused("first-block-caching", _DIFFUSION),
    Refused("force", "maxjax checks every flag against the model and refuses what it cannot "
            "serve; there is no check to skip"),
    Refused("gpu-profiling", "maxjax has no GPU profiler switch: use `maxjax generate "
            "--profile` or /metrics' maxjax_step_phase_seconds_total", str, (None, "off"),
            ("off", "on", "detailed")),
    Refused("headless", "the API server and the engine run in one process"),
    Refused("indexer-kv-cache-format", "no maxjax architecture has a sparse-indexer cache",
            str, (None,)),
    Refused("kv-connector-config", "maxjax has no host or disk KV tier (the null connector)",
            str, (None, '{"type": "null"}', '{"type":"null"}')),
    Refused("max-media-preprocess-cache-idle-seconds", _VISION, float, (None,)),
    Refused("max-video-preprocess-cache-bytes", _VISION, int, (None,)),
    Refused("max-vision-preprocess-cache-bytes", _VISION, int, (None,)),
    Refused("model-override", "maxjax serves one model per server, without a model manifest",
            str, (None,)),
    Refused("models", "maxjax serves one model per server, without a model manifest",
            str, (None,)),
    Refused("pipeline-role", _DISAGG, str,
            (None, "prefill_and_decode"), ("prefill_and_decode", "prefill_only", "decode_only")),
    Refused("prefer-module-v3", "ModuleV3 is MAX's graph API; maxjax's graphs are JAX"),
    Refused("sample-on-host", "sampling is part of the compiled step (with --devices cpu "
            "that step runs on the host CPU already)"),
    Refused("section-name", "maxjax reads no config-file sections", str, (None,)),
    Refused("task-arg", "no maxjax task takes task-specific arguments", str, (None,)),
    Refused("taylorseer", _DIFFUSION),
    Refused("taylorseer-cache-interval", _DIFFUSION, int, (None,)),
    Refused("taylorseer-max-order", _DIFFUSION, int, (None,)),
    Refused("taylorseer-warmup-steps", _DIFFUSION, int, (None,)),
    Refused("thinking-temperature", "a temperature inside <think> blocks is not supported yet; "
            "set the request's temperature", float, (None,)),
    Refused("use-subgraphs", "maxjax unrolls the layer loop (a scan over layers made XLA:CPU "
            "copy the KV pool every step)", bool, (None, False)),
    Refused("use-vendor-blas", "XLA picks its matmul libraries"),
    Refused("use-vendor-ccl", "XLA picks its collective libraries"),
    Refused("vision-cache-utilization", _VISION, float, (None,)),
    Refused("vision-config-overrides", _VISION, str, (None,)),
]


def _dest(name: str) -> str:
    return name.replace("-", "_")


def _field(r: Refused):
    meta = {"help": f"Not served by maxjax: {r.why}"}
    if r.choices:
        meta["choices"] = list(r.choices)
    return (_dest(r.name), r.kind | None, field(default=None, metadata=meta))


ReferenceOnly = dataclasses.make_dataclass("ReferenceOnly", [_field(r) for r in REFUSED])


def check(values) -> None:
    """A one-line UserError for the first flag given a value maxjax does not serve."""
    for r in REFUSED:
        value = getattr(values, _dest(r.name))
        if value not in r.accept:
            shown = f"no-{r.name}" if value is False else \
                r.name + ("" if value is True else f" {value}")
            ok = [a for a in r.accept if a is not None]
            also = "" if r.kind is bool or not ok else f" (supported: {', '.join(map(str, ok))})"
            raise UserError(f"--{shown}: not supported: {r.why}{also}")
