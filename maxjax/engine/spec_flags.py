"""Speculative decoding's flags, checked at start-up by the plan (`draft_tokens` calls `check`):
which need --speculative-method or its draft method, the per-batch-size schedule, and the
acceptance options maxjax serves (the rest are one-line refusals)."""
from __future__ import annotations

import dataclasses
import json

from maxjax.errors import UserError

# Fields that configure speculative decoding only: given without --speculative-method, an error.
SPEC_ONLY = ("num_speculative_tokens", "draft_model_path", "draft_quantization_encoding",
             "draft_devices", "use_greedy_acceptance", "prompt_lookup_min", "prompt_lookup_max",
             "draft_proposal", "rejection_sampling_strategy",
             "num_speculative_tokens_per_batch_size", "num_speculative_tokens_mixed_batch",
             "enable_spec_decode_mixed_batches", "use_relaxed_acceptance_for_thinking",
             "relaxed_delta", "relaxed_topk", "synthetic_acceptance_rate")
DRAFT_ONLY = ("draft_quantization_encoding", "draft_devices")
STRATEGIES = "residual (the default), greedy"
_KEYS = ("batch_start", "batch_end", "num_tokens")
DEFAULT_TOKENS = {"ngram": 7, "draft": 4, "mtp": 1}   # mtp: one per MTP layer used


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def given(cfg, names) -> list[str]:
    """The fields among `names` that differ from their defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    return [n for n in names if getattr(cfg, n) != defaults[n]]


def draft_tokens(cfg) -> int:
    """The most drafts per request and step the config asks for (0: no speculation); a
    UserError for flags that do not go together."""
    method = cfg.speculative_method
    k = cfg.num_speculative_tokens
    draft_flags = [f"--draft-{n.replace('_', '-')}" for n in cfg.draft_source().options()]
    if draft_flags and cfg.draft_model_path is None:
        raise UserError(f"{draft_flags[0]} goes with --draft-model-path (--speculative-method "
                        "draft)")
    if cfg.draft_max_length is not None and cfg.draft_model_path is None:
        raise UserError("--draft-max-length goes with --draft-model-path (--speculative-method "
                        "draft)")
    if method is None:
        check_without_method(cfg)
        return 0
    if method not in DEFAULT_TOKENS:
        raise UserError(f"--speculative-method {method}: not supported here; supported: "
                        f"{', '.join(DEFAULT_TOKENS)}")
    if k is not None and k < 1:
        raise UserError(f"--num-speculative-tokens must be >= 1 (got {k})")
    if method == "ngram" and not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
        raise UserError(f"--prompt-lookup-min {cfg.prompt_lookup_min} and --prompt-lookup-max "
                        f"{cfg.prompt_lookup_max}: need 1 <= min <= max")
    if (method == "draft") != (cfg.draft_model_path is not None):
        raise UserError("--draft-model-path goes with --speculative-method draft, and only "
                        "with it")
    k = k or DEFAULT_TOKENS[method]
    check(cfg, k)
    return k


def check_without_method(cfg) -> None:
    for name in given(cfg, SPEC_ONLY)[:1]:
        raise UserError(f"{flag(name)} configures speculative decoding: it needs "
                        f"--speculative-method")


def check(cfg, k: int) -> None:
    """UserError for the speculative flags that cannot be served with method `cfg`'s and at
    most `k` drafts per request."""
    if cfg.speculative_method != "draft":
        for name in given(cfg, DRAFT_ONLY)[:1]:
            raise UserError(f"{flag(name)} goes with --speculative-method draft (not "
                            f"{cfg.speculative_method})")
    from maxjax.engine import devices
    devices.parse(cfg.draft_devices, "--draft-devices")     # its devices: draft.draft_mesh
    if cfg.draft_proposal != "argmax":
        raise UserError(f"--draft-proposal {cfg.draft_proposal}: the draft proposes its argmax "
                        f"only (a sampled proposal needs its distribution in verification, not "
                        f"implemented); supported: argmax")
    strategy = cfg.rejection_sampling_strategy
    if strategy not in (None, "residual", "greedy"):
        raise UserError(f"--rejection-sampling-strategy {strategy}: not implemented; "
                        f"supported: {STRATEGIES}")
    if strategy == "residual" and cfg.use_greedy_acceptance:
        raise UserError("--use-greedy-acceptance contradicts --rejection-sampling-strategy "
                        "residual")
    if cfg.use_relaxed_acceptance_for_thinking:
        raise UserError("--use-relaxed-acceptance-for-thinking: relaxed acceptance inside "
                        "<think> is not implemented (drafts are verified strictly everywhere)")
    for name in ("relaxed_delta", "relaxed_topk"):
        if getattr(cfg, name) is not None:
            raise UserError(f"{flag(name)} needs --use-relaxed-acceptance-for-thinking")
    rate = cfg.synthetic_acceptance_rate
    if rate is not None:
        if not 0.0 <= rate <= 1.0:
            raise UserError(f"--synthetic-acceptance-rate {rate}: expected 0.0 to 1.0")
        if greedy_only(cfg):
            raise UserError("--synthetic-acceptance-rate is incompatible with greedy "
                            "acceptance (--use-greedy-acceptance)")
    mixed = cfg.num_speculative_tokens_mixed_batch
    if mixed is not None and not 0 <= mixed <= k:
        raise UserError(f"--num-speculative-tokens-mixed-batch {mixed}: expected 0 to {k} "
                        f"(--num-speculative-tokens)")
    batch_schedule(cfg.num_speculative_tokens_per_batch_size, k)


def greedy_only(cfg) -> bool:
    """Greedy acceptance: only greedy requests are verified against drafts."""
    return cfg.use_greedy_acceptance or cfg.rejection_sampling_strategy == "greedy"


def batch_schedule(text, k: int) -> list[tuple[int, int, int]]:
    """--num-speculative-tokens-per-batch-size as (first, last, tokens) ranges, in order; a
    UserError naming what is wrong."""
    if text is None:
        return []
    name = "--num-speculative-tokens-per-batch-size"
    try:
        entries = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as e:
        raise UserError(f"{name}: not JSON ({e.msg} at char {e.pos})") from None
    shape = (f'expected a JSON list of {{"batch_start": N, "batch_end": N, "num_tokens": N}} '
             f"objects")
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and set(e) == set(_KEYS)
            and all(type(e[key]) is int for key in _KEYS) for e in entries):
        raise UserError(f"{name}: {shape}")
    ranges = sorted((e["batch_start"], e["batch_end"], e["num_tokens"]) for e in entries)
    for i, (start, end, n) in enumerate(ranges):
        if not 1 <= start <= end:
            raise UserError(f"{name}: range {start}-{end}: need 1 <= batch_start <= batch_end")
        if not 0 <= n <= k:
            raise UserError(f"{name}: num_tokens {n}: expected 0 to {k} "
                            f"(--num-speculative-tokens)")
        if i and start <= ranges[i - 1][1]:
            raise UserError(f"{name}: ranges {ranges[i - 1][0]}-{ranges[i - 1][1]} and "
                            f"{start}-{end} overlap")
    return ranges


def calibrated_rate(rate: float, k: int) -> float:
    """The per-position acceptance a with mean(a, a^2, ..., a^k) == rate (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** j for j in range(1, k + 1)) / k < rate:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2
