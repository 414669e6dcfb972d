"""--kv-events-config (issue 60, KV events): a ZMQ subscriber decodes, with the structs vLLM's
examples/online_serving/kv_events_subscriber.py copies from vllm/distributed/kv_events.py, the
BlockStored events of a tiny Llama's requests (their full pages' tokens, hashes chained by
parent) and the BlockRemoved events of the pages evicted to make room (as many as the pool
counts), in sequence; the replay socket resends them; a pool reset sends AllBlocksCleared.
/metrics carries the Gateway API Inference Extension's vLLM names. A bad flag is one line."""
from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from maxjax.engine.async_engine import AsyncEngine
from maxjax.engine.config import EngineConfig
from maxjax.engine.plan import check_flags
from maxjax.engine.types import SamplingParams
from maxjax.errors import UserError
from server_harness import ServerThread, http
from tiny_llama import tiny_core


# ---- the subscriber's types, as vLLM's example copies them ---------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = Decoder(type=KVEventBatch).decode
PAGE = 8                       # tiny_core's page size; its pool: 23 usable pages
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
# 8 prompts of 33 distinct tokens: 4 full pages each once decoded, 32 pages for a pool of 23
PROMPTS = {f"p{i}": list(range(3 + 40 * i, 36 + 40 * i)) for i in range(8)}
TOPIC = b"kv-events"


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    d = tmp_path_factory.mktemp("kvev")
    pub, replay = f"ipc://{d}/pub", f"ipc://{d}/replay"
    core = tiny_core(d / "model", kv_events_config=json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
        "replay_endpoint": replay, "topic": TOPIC.decode()}))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    state = {"core": core, "sub": sub, "replay": replay, "messages": {}, "tokens": {}}
    yield state
    sub.close(linger=0)
    core.kv_events.close()


def run(core, rid, prompt) -> list[int]:
    core.add_request(rid, prompt, GREEDY)
    tokens = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
    return tokens


def receive(state, timeout_ms: int) -> bool:
    """One message into state["messages"] (seq -> payload); False when none came in time."""
    if not state["sub"].poll(timeout_ms):
        return False
    topic, seq, payload = state["sub"].recv_multipart()
    assert topic == TOPIC and len(seq) == 8
    seq = int.from_bytes(seq, "big")
    assert seq not in state["messages"] and all(seq > s for s in state["messages"])
    state["messages"][seq] = payload
    return True


def batches(state):
    return [DECODE(state["messages"][s]) for s in sorted(state["messages"])]


def stored_index(state) -> dict:
    """(parent hash, page tokens) -> hash, over every BlockStored received."""
    index = {}
    for batch in batches(state):
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.block_size == PAGE and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == PAGE * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for j, h in enumerate(ev.block_hashes):
                    index[(parent, tuple(ev.token_ids[j * PAGE:(j + 1) * PAGE]))] = h
                    parent = h
    return index


def chain(index, tokens: list[int]) -> list[int] | None:
    """The hashes of `tokens`' full pages chained from the root, None where one is missing."""
    hashes, parent = [], None
    for k in range(len(tokens) // PAGE):
        parent = index.get((parent, tuple(tokens[k * PAGE:(k + 1) * PAGE])))
        if parent is None:
            return None
        hashes.append(parent)
    return hashes


def test_a_subscriber_decodes_the_pages_stored_and_evicted(events):
    core = events["core"]
    # A SUB socket misses what is sent before its subscription arrives: probe until one lands.
    for i in range(40):
        run(core, f"probe{i}", list(range(400 + i, 409 + i)))
        if receive(events, 1000):
            break
    else:
        pytest.fail("no KV event reached the subscriber")
    first = min(events["messages"])
    for rid, prompt in PROMPTS.items():
        events["tokens"][rid] = prompt + run(core, rid, prompt)
    last = core.kv_events.publisher.next_seq - 1
    while max(events["messages"]) < last:
        assert receive(events, 60_000), f"batch {last} never arrived"
    want = {rid: seq[:-1][:4 * PAGE] for rid, seq in events["tokens"].items()}  # computed tokens
    seqs = sorted(events["messages"])
    assert seqs == list(range(first, first + len(seqs)))       # in order, none dropped

    index = stored_index(events)
    chains = {rid: chain(index, toks) for rid, toks in want.items()}
    assert all(c is not None and len(c) == 4 for c in chains.values()), chains
    all_hashes = [h for c in chains.values() for h in c]
    assert len(set(all_hashes)) == len(all_hashes)

    stored, removed = [], []
    for batch in batches(events):
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                stored += ev.block_hashes
            elif isinstance(ev, BlockRemoved):
                assert ev.medium == "GPU"
                assert set(ev.block_hashes) <= set(stored)     # only pages stored before
                removed += ev.block_hashes
    bm = core.block_manager
    assert len(removed) == bm.evictions > 0                    # every eviction, once
    assert set(chains["p0"]) <= set(removed)                   # least recently used went first
    assert not set(chains["p7"]) & set(removed)
    assert len(set(stored) - set(removed)) == bm.num_cached_pages
    assert bm.stats().events_dropped == 0


def test_the_replay_socket_resends_every_batch_from_a_sequence_number(events):
    # a DEALER speaks REQ's envelope ([b"", start]) and takes the many answers REQ would refuse
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(events["replay"])
    first = min(events["messages"])
    try:
        req.send_multipart((b"", first.to_bytes(8, "big")))
        got = {}
        while True:
            assert req.poll(60_000), "no replay answer"
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            got[int.from_bytes(seq, "big")] = payload
    finally:
        req.close(linger=0)
    assert {s: p for s, p in got.items() if s in events["messages"]} == events["messages"]
    assert min(got) == first


def test_a_pool_reset_removes_every_cached_page_and_clears(events):
    core = events["core"]
    cached = core.block_manager.num_cached_pages
    assert cached > 0
    core.replace_kv()
    assert receive(events, 60_000)
    last = DECODE(events["messages"][max(events["messages"])])
    assert isinstance(last.events[-1], AllBlocksCleared)
    assert sum(len(ev.block_hashes) for ev in last.events[:-1]
               if isinstance(ev, BlockRemoved)) == cached
    assert core.block_manager.num_cached_pages == 0


def test_metrics_carry_the_inference_extension_names(events):
    core = events["core"]
    engine = AsyncEngine(core, core.model.tokenizer, "tiny", None)
    engine.start()
    server = ServerThread(engine)
    try:
        done = http("POST", server.url + "/v1/completions",
                    {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 3})
        assert done.status_code == 200, done.text
        text = http("GET", server.url + "/metrics").text
    finally:
        server.close()
        engine.shutdown()
    samples = {line.split(" ")[0]: float(line.split(" ")[1])
               for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in text
    assert samples["vllm:num_requests_waiting"] == samples["maxjax_num_requests_waiting"]
    assert samples["vllm:num_requests_running"] == samples["maxjax_num_requests_running"]
    assert samples["vllm:kv_cache_usage_perc"] == pytest.approx(
        samples["maxjax_kv_cache_pages_used"] / samples["maxjax_kv_cache_pages_total"])
    assert samples["maxjax_kv_events_dropped_total"] == 0.0


@pytest.mark.parametrize("value, message", [
    ("{not json", r"not JSON \(Expecting property name enclosed in double quotes at character 1\)"),
    ("[1]", r"expected a JSON object, got list"),
    ('{"enable_kv_cache_events": "yes"}', r"enable_kv_cache_events must be true or false, got "
                                          r"\"yes\""),
    ('{"enable": true}', r"unknown key 'enable' \(known: enable_kv_cache_events, publisher, "),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}',
     r"publisher must be \"zmq\" or \"null\", got 'kafka'"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}',
     r"endpoint must be a tcp://, ipc:// or inproc:// address, got 'localhost:5557'"),
    ('{"max_queue_size": 0}', r"max_queue_size must be >= 1, got 0"),
    ('{"hwm": true}', r"hwm must be an integer, got true"),
])
def test_a_bad_config_is_a_one_line_error(value, message):
    with pytest.raises(UserError, match=rf"^--kv-events-config: {message}"):
        check_flags(EngineConfig(kv_events_config=value))


def test_events_are_off_by_default_and_when_disabled():
    assert EngineConfig().kv_events_config is None
    check_flags(EngineConfig(kv_events_config='{"enable_kv_cache_events": false}'))


def test_the_cli_prints_a_bad_config_as_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "maxjax.cli", "serve", "--model-path", str(tmp_path),
                        "--kv-events-config", '{"enable_kv_cache_events": 1}'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].endswith("--kv-events-config: enable_kv_cache_events must be true or "
                              "false, got 1"), r.stderr
    assert "Traceback" not in r.stderr


def test_a_full_queue_drops_batches_without_waiting(tmp_path):
    from maxjax.engine.kv_events import parse_config
    from maxjax.engine.kv_events_zmq import EventBatch as Sent, ZmqPublisher
    cfg = parse_config(json.dumps({"enable_kv_cache_events": True, "max_queue_size": 1,
                                   "endpoint": f"ipc://{tmp_path}/full"}))
    publisher = ZmqPublisher(cfg)
    publisher.close(timeout=60)         # its thread gone: nothing drains the queue of one
    for _ in range(3):
        publisher.publish(Sent(0.0, []))
    assert (publisher.dropped, publisher.next_seq) == (2, 3)
