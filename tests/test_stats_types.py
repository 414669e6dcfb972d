"""The typed contracts between the engine and the server: FinishReason's wire values (under every
API: OpenAI, Anthropic's stop_reason, the Responses API's status), EngineStats summed over
replicas, and the /metrics samples (which /stats shows) read from them, pinned to the values the
old stats dicts gave."""
import dataclasses
import json

from mock_engine import MockEngine
from server_harness import ServerThread, http

from maxjax.engine.stats import EngineStats, KVCacheStats, ReplicaStats, SchedulerStats, SpecStats
from maxjax.engine.types import FinishReason, RequestOutput
from maxjax.server.metrics import ServerMetrics


def test_finish_reason_is_its_wire_string():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error",
                                               "grammar_error", "tool_calls"]
    for r in FinishReason:
        assert r == r.value and str(r) == f"{r}" == r.value
        assert json.dumps({"finish_reason": r}) == json.dumps({"finish_reason": r.value})
    out = RequestOutput("r", [], finished=True, finish_reason=FinishReason.LENGTH)
    assert json.loads(json.dumps(dataclasses.asdict(out)))["finish_reason"] == "length"


def test_every_api_sends_the_same_strings():
    server = ServerThread(MockEngine(script="ok"))      # "ok" then EOS: STOP, or LENGTH at 1
    post = lambda path, body: http("POST", server.url + path, body).json()  # noqa: E731
    chat = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
    try:
        for n, reason, stop_reason, status in ((1, "length", "max_tokens", "incomplete"),
                                               (5, "stop", "end_turn", "completed")):
            got = post("/v1/chat/completions", {**chat, "max_tokens": n})
            assert got["choices"][0]["finish_reason"] == reason
            got = post("/v1/completions", {"model": "mock-model", "prompt": "hi", "max_tokens": n})
            assert got["choices"][0]["finish_reason"] == reason
            got = post("/v1/messages", {**chat, "max_tokens": n})
            assert (got["stop_reason"], got["stop_sequence"]) == (stop_reason, None)
            got = post("/v1/responses", {"model": "mock-model", "input": "hi",
                                         "max_output_tokens": n})
            assert got["status"] == status
    finally:
        server.close()


def _replica(running: int, steps: int) -> EngineStats:
    return EngineStats(
        SchedulerStats(waiting=1, running=running, preemptions=2, scheduled_tokens=70,
                       scheduled_rows=20),
        KVCacheStats(pages_used=5, pages_total=100, prefix_query_tokens=40, prefix_hit_tokens=12,
                     pages_cached=3),
        SpecStats(4, 10, 6, (4, 4, 2), (3, 2, 1)), steps=steps, xla_compiles=9,
        step_seconds={"schedule": 0.5, "device_step": 2.0})


def test_total_sums_every_field_over_replicas_but_the_process_wide_compile_count():
    a, b = _replica(2, 11), _replica(0, 3)
    b = dataclasses.replace(b, spec=SpecStats(1, 1, 1, (1,), (1,)),
                            step_seconds={"device_step": 1.0, "update": 0.25})
    total = EngineStats.total([a, b])
    assert total.scheduler == SchedulerStats(waiting=2, running=2, preemptions=4,
                                             scheduled_tokens=140, scheduled_rows=40)
    assert total.kv == KVCacheStats(pages_used=10, pages_total=200, prefix_query_tokens=80,
                                    prefix_hit_tokens=24, pages_cached=6)
    assert total.spec == SpecStats(5, 11, 7, (5, 4, 2), (4, 2, 1))
    # replicas in one process each report its compiles (9 for both): counted once, not twice
    assert (total.steps, total.xla_compiles, total.replicas) == (14, 9, ())
    assert total.step_seconds == {"schedule": 0.5, "device_step": 3.0, "update": 0.25}
    assert EngineStats.total([]) == EngineStats()


# What /metrics (and /stats's "metrics") showed for the old stats dicts of these two replicas.
_WANT = {
    "maxjax_engine_scheduled_rows_total": 20.0, "maxjax_engine_scheduled_tokens_total": 70.0,
    "maxjax_engine_steps_total": 11.0, "maxjax_kv_cache_pages_cached": 3.0,
    "maxjax_kv_cache_pages_total": 100.0, "maxjax_kv_cache_pages_used": 5.0,
    "maxjax_num_requests_running": 2.0, "maxjax_num_requests_waiting": 1.0,
    "maxjax_preemptions_total": 2.0, "maxjax_prefix_cache_hits_total": 12.0,
    "maxjax_prefix_cache_queries_total": 40.0,
    "maxjax_replica_engine_steps_total": {"0": 11.0, "1": 3.0},
    "maxjax_replica_kv_cache_pages_used": {"0": 5.0, "1": 5.0},
    "maxjax_replica_requests_in_flight": {"0": 2.0, "1": 0.0},
    "maxjax_replica_requests_prefix_routed_total": {"0": 1.0, "1": 0.0},
    "maxjax_replica_requests_routed_total": {"0": 5.0, "1": 7.0},
    "maxjax_replica_requests_running": {"0": 2.0, "1": 0.0},
    "maxjax_replica_requests_waiting": {"0": 1.0, "1": 1.0},
    "maxjax_replica_up": {"0": 1.0, "1": 0.0},
    "maxjax_spec_decode_acceptance_rate": {"0": 0.75, "1": 0.5, "2": 0.5},
    "maxjax_spec_decode_mean_accepted_tokens": 1.5,
    "maxjax_spec_decode_num_accepted_tokens_per_pos_total": {"0": 3.0, "1": 2.0, "2": 1.0},
    "maxjax_spec_decode_num_accepted_tokens_total": 6.0,
    "maxjax_spec_decode_num_draft_tokens_total": 10.0,
    "maxjax_spec_decode_num_drafts_total": 4.0,
    "maxjax_step_phase_seconds_total": {"device_step": 2.0, "schedule": 0.5},
    "maxjax_xla_compiles_since_ready_total": 0.0, "maxjax_xla_compiles_total": 9.0,
    "maxjax_grammar_faults_total": 0.0, "maxjax_kv_events_dropped_total": 0.0,
    # the Gateway API Inference Extension's names, from the same stats
    "vllm:num_requests_waiting": 1.0, "vllm:num_requests_running": 2.0,
    "vllm:kv_cache_usage_perc": 0.05,
}


class _Engine:
    def __init__(self, stats):
        self.stats = lambda: stats


_SERVER_OWN = ("process_", "maxjax_requests_", "maxjax_prompt_tokens_", "maxjax_generation_tokens_",
               "maxjax_time_to_first_token_", "maxjax_inter_token_latency_",
               "maxjax_request_latency_", "maxjax_server_")


def _engine_samples(stats) -> dict:
    """The samples read from `stats`: all but the server's own."""
    snap = ServerMetrics(_Engine(stats)).snapshot()
    return {k: v for k, v in snap.items() if not k.startswith(_SERVER_OWN)}


def test_metrics_from_the_dataclasses_are_the_old_ones():
    replicas = (ReplicaStats(_replica(2, 11), up=True, routed=5, prefix_routed=1, in_flight=2),
                ReplicaStats(_replica(0, 3), up=False, routed=7, prefix_routed=0, in_flight=0))
    # the first replica's numbers as the engine's: the old pin held the replicas' sum apart
    stats = dataclasses.replace(_replica(2, 11), replicas=replicas)
    assert _engine_samples(stats) == _WANT


def test_an_engine_without_stats_scrapes_as_zeros():
    got = _engine_samples(EngineStats())
    assert not any(k.startswith("maxjax_replica_") for k in got)
    assert "maxjax_spec_decode_acceptance_rate" not in got      # no positions, no samples
    assert got["maxjax_kv_cache_pages_total"] == got["maxjax_engine_steps_total"] == 0.0
