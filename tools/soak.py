"""Soak a running `maxjax serve` (or one this tool starts) with mixed valid traffic:

  python tools/soak.py [--url URL | -- SERVE FLAGS...] [--streams 64] [--duration 600]
                       [--abort-rate 0.1] [--json OUT]

N concurrent streams send chat and completions requests, streamed or not, with n > 1,
logprobs, stop strings, seeds, short and long prompts (tools/reliability.py: random_request);
a share of the streamed ones is abandoned mid-stream. Every answer is checked (schema of the
server's /openapi.json, every choice, finish reasons, token budget, stop strings, logprobs).
/metrics is sampled every --interval seconds. Reports errors, latency percentiles per time
window, RSS over time and its slope after the first fifth of the run, KV pages in use at the end
(only what the prefix cache holds may remain), tasks and file descriptors, and the compile count
while serving (must be 0). Exits 1 on any error or leak."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reliability import (SMOLLM2_FLAGS, ServeProcess, ValidTraffic, leak_report,  # noqa: E402
                         metrics)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)
    pick = lambda q: round(v[min(len(v) - 1, int(q * len(v)))], 3)  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(v[-1], 3)}


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return None if den == 0 else 60 * sum((t - mt) * (v - mv) for t, v in points) / den


class Sampler:
    """/metrics every `interval` seconds on a thread: (t, RSS MB, fds, KV used, KV cached,
    running, waiting)."""

    def __init__(self, url: str, interval: float, headers=None):
        self.url, self.interval, self.headers = url, interval, headers
        self.rows: list[tuple] = []
        self._stop = threading.Event()

    def __enter__(self):
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                m = metrics(self.url, self.headers)
            except OSError:
                continue
            self.rows.append((round(time.monotonic() - self.t0, 1),
                              round(m.get("process_resident_memory_bytes", 0) / 2**20, 1),
                              m.get("process_open_fds"), m.get("maxjax_kv_cache_pages_used"),
                              m.get("maxjax_kv_cache_pages_cached"),
                              m.get("maxjax_num_requests_running"),
                              m.get("maxjax_num_requests_waiting")))


def run_soak(url: str, streams: int = 64, duration: float = 600, seed: int = 0,
             abort_rate: float = 0.1, interval: float = 5.0, headers=None,
             windows: int = 10) -> dict:
    before = metrics(url, headers)
    with Sampler(url, interval, headers) as sampler:
        traffic = ValidTraffic(url, streams, seed, headers, duration, abort_rate)
        with traffic:
            traffic.wait()
    leaks = leak_report(url, before, headers)
    width = duration / windows
    latency = []
    for w in range(windows):
        s = [x for x in traffic.samples if w * width <= x[0] < (w + 1) * width]
        latency.append({"from_s": round(w * width), "requests": len(s),
                        "e2e_s": percentiles([x[2] for x in s]),
                        "ttft_s": percentiles([x[3] for x in s if x[3] is not None])})
    rss = [(t, mb) for t, mb, *_ in sampler.rows]
    settled = [p for p in rss if p[0] >= duration / 5]
    report = {"streams": streams, "duration_s": duration, **traffic.report(),
              "requests_per_s": round(traffic.done / duration, 2),
              "e2e_s": percentiles([x[2] for x in traffic.samples]),
              "ttft_s": percentiles([x[3] for x in traffic.samples if x[3] is not None]),
              "latency_over_time": latency,
              "rss_mb": {"start": rss[0][1] if rss else None,
                         "end": rss[-1][1] if rss else None,
                         "max": max((mb for _, mb in rss), default=None),
                         "slope_mb_per_min": None if slope_per_min(settled) is None
                         else round(slope_per_min(settled), 2)},
              "samples": sampler.rows, "leaks": leaks}
    report["passed"] = not traffic.errors and not leaks["problems"]
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start `maxjax serve SERVE FLAGS`)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--duration", type=float, default=600.0, help="seconds")
    p.add_argument("--abort-rate", type=float, default=0.1,
                   help="share of streamed requests the client abandons mid-stream")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between /metrics samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=os.environ.get("MAXJAX_API_KEY"))
    p.add_argument("--json", help="write the report here")
    p.add_argument("serve", nargs=argparse.REMAINDER, help="-- then flags for maxjax serve")
    a = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
    flags = [f for f in a.serve if f != "--"] or SMOLLM2_FLAGS
    args = (a.streams, a.duration, a.seed, a.abort_rate, a.interval, headers)
    if a.url:
        report = run_soak(a.url, *args)
    else:
        with ServeProcess(flags) as server:
            report = run_soak(server.url, *args)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=1))
    print("PASS" if report["passed"] else "FAIL")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
