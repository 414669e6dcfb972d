"""Numbers and pictures for `maxjax benchmark` (maxjax/bench/command.py) and tools/compare_peers.py:
one level's RequestResults -> a summary dict (throughput, TTFT / TPOT / ITL / end-to-end latency
mean and percentiles, errors), a text or markdown table of summaries, and a PNG plot of
throughput and TTFT against concurrency (or request rate), one line per server.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from maxjax.errors import UserError

PERCENTILES = (50, 90, 99)
MAX_ERROR_SAMPLES = 5


def distribution(values_s: list[float]) -> dict:
    """mean and percentiles of a list of seconds, in milliseconds (None when empty)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(results: list, duration_s: float, **level) -> dict:
    """`level` names the load (concurrency=C or request_rate=R); results are RequestResults."""
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration_s = max(duration_s, 1e-9)
    return {
        **level,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": [f"{n}x {msg}" for msg, n in errors.most_common(MAX_ERROR_SAMPLES)],
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "usage_reported": bool(ok) and all(r.usage_reported for r in ok),
        # Answers shorter than max_tokens: EOS, or a server that cut the stream (with
        # ignore_eos this means the server ignored it, or interrupted the request).
        "short_outputs": sum(r.output_tokens < r.requested_tokens for r in ok),
        "requests_per_s": len(ok) / duration_s,
        "output_tok_per_s": out_tokens / duration_s,
        "total_tok_per_s": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itl]),
        "e2e_ms": distribution([r.latency for r in ok]),
    }


def level_label(summary: dict) -> str:
    if "concurrency" in summary:
        return f"c={summary['concurrency']}"
    return f"rate={summary['request_rate']:g}/s"


_LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def throughput_rows(summaries: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["load", "ok", "errors", "in tokens", "out tokens", "seconds", "req/s", "out tok/s",
            "total tok/s"]
    return head, [[level_label(s), str(s["completed"]), str(s["errors"]), str(s["input_tokens"]),
                   str(s["output_tokens"]), f"{s['duration_s']:.2f}", _fmt(s["requests_per_s"]),
                   _fmt(s["output_tok_per_s"]), _fmt(s["total_tok_per_s"])] for s in summaries]


def latency_rows(summaries: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["load", "latency (ms)", "mean"] + [f"p{p}" for p in PERCENTILES]
    rows = []
    for s in summaries:
        for name, key in _LATENCIES:
            d = s[key]
            rows.append([level_label(s), name, _fmt(d["mean"])]
                        + [_fmt(d[f"p{p}"]) for p in PERCENTILES])
    return head, rows


def compact_rows(series: dict[str, list[dict]]) -> tuple[list[str], list[list[str]]]:
    """One row per (server, level): the numbers a comparison needs."""
    head = ["server", "load", "out tok/s", "total tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
            "TPOT p50 ms", "E2E p50 ms", "errors"]
    rows = []
    for name, summaries in series.items():
        for s in summaries:
            rows.append([name, level_label(s), _fmt(s["output_tok_per_s"]),
                         _fmt(s["total_tok_per_s"]), _fmt(s["requests_per_s"]),
                         _fmt(s["ttft_ms"]["p50"]), _fmt(s["ttft_ms"]["p99"]),
                         _fmt(s["tpot_ms"]["p50"]), _fmt(s["e2e_ms"]["p50"]), str(s["errors"])])
    return head, rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plot(series: dict[str, list[dict]], path: str, title: str = "") -> None:
    """One line per series (server) of output tok/s and TTFT p50 against the load level."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UserError("--plot needs matplotlib: pip install matplotlib") from e
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    xlabel, ticks = "concurrency", set()
    for name, summaries in series.items():
        key = "concurrency" if all("concurrency" in s for s in summaries) else "request_rate"
        xlabel = "concurrency" if key == "concurrency" else "request rate (req/s)"
        pts = sorted(((s[key], s) for s in summaries if s["completed"]), key=lambda p: p[0])
        ticks.update(x for x, _ in pts)
        for ax, value in ((ax_tp, lambda s: s["output_tok_per_s"]),
                          (ax_ttft, lambda s: s["ttft_ms"]["p50"])):
            xy = [(x, value(s)) for x, s in pts if value(s) is not None]
            if xy:
                ax.plot(*zip(*xy), marker="o", label=name)
    for ax, ylabel in ((ax_tp, "output tokens/s"), (ax_ttft, "TTFT p50 (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(sorted(ticks), [f"{t:g}" for t in sorted(ticks)])
            ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_ttft.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise UserError(f"--plot {path}: {e.strerror or e}") from e
    finally:
        plt.close(fig)
