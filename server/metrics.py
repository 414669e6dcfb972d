"""Prometheus metrics of one server app, in its own CollectorRegistry (so several apps can live in
one process, as in tests): request/token counters and latency histograms the handlers update,
plus the engine's gauges and counters read from `engine.stats()` (an EngineStats,
maxjax/engine/stats.py) by attribute at scrape time."""
from __future__ import annotations

import asyncio
import logging
from operator import attrgetter

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from maxjax.engine.stats import EngineStats

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
# (EngineStats attribute, metric name, kind, help); "replicas.X": X of each replica's ReplicaStats,
# one sample per replica of --data-parallel-degree
_ENGINE_METRICS = (
    ("scheduler.waiting", "maxjax_num_requests_waiting", "gauge", "Requests queued in the engine"),
    ("scheduler.running", "maxjax_num_requests_running", "gauge", "Requests in the running batch"),
    ("kv.pages_used", "maxjax_kv_cache_pages_used", "gauge", "KV cache pages in use"),
    ("kv.pages_total", "maxjax_kv_cache_pages_total", "gauge", "KV cache pages in the pool"),
    ("kv.prefix_query_tokens", "maxjax_prefix_cache_queries", "counter",
     "Prompt tokens looked up in the prefix cache"),
    ("kv.prefix_hit_tokens", "maxjax_prefix_cache_hits", "counter",
     "Prompt tokens found in the prefix cache"),
    ("scheduler.preemptions", "maxjax_preemptions", "counter",
     "Requests preempted for lack of KV pages"),
    ("xla_compiles", "maxjax_xla_compiles", "counter", "XLA compilations since start"),
    ("xla_compiles_since_ready", "maxjax_xla_compiles_since_ready", "counter",
     "XLA compilations inside serving steps (must stay 0)"),
    ("grammar_faults", "maxjax_grammar_faults", "counter",
     "Sampled tokens their grammar refused: a server fault (must stay 0)"),
    ("steps", "maxjax_engine_steps", "counter", "Engine steps run"),
    ("scheduler.scheduled_rows", "maxjax_engine_scheduled_rows", "counter",
     "Rows (requests) over all engine steps"),
    ("scheduler.scheduled_tokens", "maxjax_engine_scheduled_tokens", "counter",
     "Tokens over all engine steps (prefill and decode)"),
    ("kv.pages_cached", "maxjax_kv_cache_pages_cached", "gauge",
     "Free KV pages still holding a reusable prefix"),
    ("spec.rows_verified", "maxjax_spec_decode_num_drafts", "counter",
     "Speculative decoding: request rows that verified draft tokens in a step"),
    ("spec.draft_tokens", "maxjax_spec_decode_num_draft_tokens", "counter",
     "Speculative decoding: draft tokens verified"),
    ("spec.accepted_tokens", "maxjax_spec_decode_num_accepted_tokens", "counter",
     "Speculative decoding: draft tokens accepted"),
    ("kv.events_dropped", "maxjax_kv_events_dropped", "counter",
     "KV event batches dropped because the publisher's queue was full (--kv-events-config)"),
    # The names the Gateway API Inference Extension's model-server protocol reads from a
    # vLLM-compatible server (TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization).
    ("scheduler.waiting", "vllm:num_requests_waiting", "gauge", "Requests queued in the engine"),
    ("scheduler.running", "vllm:num_requests_running", "gauge", "Requests in the running batch"),
    ("kv.usage", "vllm:kv_cache_usage_perc", "gauge", "KV cache usage (1 means 100 percent)"),
    ("replicas.up", "maxjax_replica_up", "gauge",
     "1 while the replica serves, 0 once it failed"),
    ("replicas.engine.scheduler.running", "maxjax_replica_requests_running", "gauge",
     "Requests running"),
    ("replicas.engine.scheduler.waiting", "maxjax_replica_requests_waiting", "gauge",
     "Requests queued"),
    ("replicas.in_flight", "maxjax_replica_requests_in_flight", "gauge",
     "Requests routed, unfinished"),
    ("replicas.engine.kv.pages_used", "maxjax_replica_kv_cache_pages_used", "gauge",
     "KV cache pages in use"),
    ("replicas.routed", "maxjax_replica_requests_routed", "counter",
     "Requests routed to the replica"),
    ("replicas.prefix_routed", "maxjax_replica_requests_prefix_routed", "counter",
     "Requests routed to the replica for the prefix it caches"),
    ("replicas.engine.steps", "maxjax_replica_engine_steps", "counter", "Engine steps run"),
)
_PER_REPLICA = "replicas."


def _family(kind: str, name: str, doc: str, labels=None):
    return (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)


class _EngineCollector:
    """One engine's metrics, or with several models (a ModelRouter: `loaded_engines`) each loaded
    one's under a `model` label; the process-wide ones (XLA compiles) once, unlabelled."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        models = getattr(self.engine, "loaded_engines", None)
        pairs = models() if models is not None else [(None, self.engine)]
        lead = ["model"] if models is not None else []
        all_stats = [([name] if lead else [], _stats_of(e)) for name, e in pairs]
        for path, name, kind, doc in _ENGINE_METRICS:
            if path.startswith(_PER_REPLICA):
                continue
            if lead and path in _PER_PROCESS:
                from maxjax.engine import compile_counter
                family = _family(kind, name, doc)
                family.add_metric([], float(max((attrgetter(path)(s) for _, s in all_stats),
                                                default=compile_counter.count())))
                yield family
                continue
            family = _family(kind, name, doc, lead or None)
            for labels, stats in all_stats:
                family.add_metric(labels, float(attrgetter(path)(stats)))
            yield family
        phases = CounterMetricFamily(
            "maxjax_step_phase_seconds", "Engine step time by phase: schedule, build_inputs, "
            "device_step (the compiled step and its transfer back), update, detokenize",
            labels=[*lead, "phase"])
        for labels, stats in all_stats:
            for phase, seconds in stats.step_seconds.items():
                phases.add_metric([*labels, phase], float(seconds))
        yield phases
        yield from _spec_metrics(all_stats, lead)
        yield from _replica_metrics(all_stats, lead)


_PER_PROCESS = ("xla_compiles",)


def _stats_of(engine) -> EngineStats:
    try:
        return engine.stats() or EngineStats()
    except Exception:   # a scrape must not fail because the engine is mid-restart
        log.exception("engine.stats() failed")
        return EngineStats()


def _replica_metrics(all_stats, lead: list[str]):
    if not any(stats.replicas for _, stats in all_stats):
        return
    for path, name, kind, doc in _ENGINE_METRICS:
        if not path.startswith(_PER_REPLICA):
            continue
        family = _family(kind, name, doc, labels=[*lead, "replica"])
        get = attrgetter(path.removeprefix(_PER_REPLICA))
        for labels, stats in all_stats:
            for i, s in enumerate(stats.replicas):
                family.add_metric([*labels, str(i)], float(get(s)))
        yield family


def _spec_metrics(all_stats, lead: list[str]):
    """Acceptance by draft position (0: the first draft after the row's last token)."""
    per_pos = CounterMetricFamily("maxjax_spec_decode_num_accepted_tokens_per_pos",
                                  "Speculative decoding: draft tokens accepted, by position",
                                  labels=[*lead, "position"])
    rate = GaugeMetricFamily("maxjax_spec_decode_acceptance_rate",
                             "Speculative decoding: accepted / verified drafts, by position",
                             labels=[*lead, "position"])
    mean = GaugeMetricFamily("maxjax_spec_decode_mean_accepted_tokens",
                             "Speculative decoding: drafts accepted per verifying row and step",
                             labels=lead or None)
    for labels, stats in all_stats:
        spec = stats.spec
        for j, (d, a) in enumerate(zip(spec.drafted_at, spec.accepted_at)):
            per_pos.add_metric([*labels, str(j)], float(a))
            rate.add_metric([*labels, str(j)], a / d if d else 0.0)
        rows = spec.rows_verified
        mean.add_metric(labels, spec.accepted_tokens / rows if rows else 0.0)
    yield from (per_pos, rate, mean)


def _task_count() -> int:
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:   # no running loop (a scrape from another thread)
        return 0


class ServerMetrics:
    """`model_label`: a server of several models (server/router.py), whose token counters and
    latencies carry the model's name (ModelMetrics hands one model's out)."""

    def __init__(self, engine, model_label: bool = False):
        self.registry = r = CollectorRegistry()
        by = ["model"] if model_label else []
        self.requests = Counter("maxjax_requests", "Finished HTTP requests",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("maxjax_prompt_tokens", "Prompt tokens processed",
                                     by, registry=r)
        self.generation_tokens = Counter("maxjax_generation_tokens", "Tokens generated",
                                         by, registry=r)
        self.ttft = Histogram("maxjax_time_to_first_token_seconds",
                              "Time from request arrival to its first token", by,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("maxjax_inter_token_latency_seconds",
                             "Time between consecutive generated tokens", by,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("maxjax_request_latency_seconds",
                             "Time from request arrival to its last token", by,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.server_waiting = Gauge("maxjax_server_requests_waiting",
                                    "Engine requests submitted that have no token yet", registry=r)
        r.register(_EngineCollector(engine))
        # process_open_fds, process_resident_memory_bytes: what tools/soak.py and tools/fuzz.py
        # watch for leaks; the task count is read on the event loop, where /metrics runs.
        ProcessCollector(registry=r)
        Gauge("maxjax_server_asyncio_tasks", "asyncio tasks alive on the server's event loop",
              registry=r).set_function(_task_count)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        """The samples /metrics renders, from one collection of the same registry: name ->
        value, or name -> {label values joined by ",": value}; histogram buckets left out."""
        out: dict = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith(("_bucket", "_created")):
                    continue
                if s.labels:
                    out.setdefault(s.name, {})[",".join(s.labels.values())] = s.value
                else:
                    out[s.name] = s.value
        return out


class ModelMetrics:
    """One model's view of a several-model server's ServerMetrics: what the routes update,
    labelled with its name; the rest shared."""
    _LABELLED = ("prompt_tokens", "generation_tokens", "ttft", "itl", "e2e")

    def __init__(self, parent: ServerMetrics, model: str):
        self.parent = parent
        for name in self._LABELLED:
            setattr(self, name, getattr(parent, name).labels(model))

    def __getattr__(self, name):
        return getattr(self.parent, name)
