"""--kv-events-config: the prefix cache's page registrations and evictions published as vLLM
publishes them (vllm/distributed/kv_events.py), so a KV-aware router (llm-d's, Dynamo's) indexes
maxjax as it indexes vLLM. Off by default. The flag is vLLM's, with vLLM's JSON:
`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}`.

This module owns the flag: its one validator (`parse_config`, run with the other start-up flag
checks) and `start`, which the EngineCore calls to hang a recorder on its BlockManager. The wire
(msgspec structs, the ZMQ publisher thread) is in kv_events_zmq.py, imported only when the
events are on: pyzmq and msgspec are the optional extra `maxjax[kv-events]`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from maxjax.errors import UserError

_FLAG = "--kv-events-config"


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig, field for field."""
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"          # vLLM: "zmq" once events are enabled, "null" publishes none
    endpoint: str = "tcp://*:5557"  # a "*", "::", ipc:// or inproc:// address binds, else connects
    replay_endpoint: str | None = None   # a ROUTER resending buffered batches from a seq number
    buffer_steps: int = 10_000      # batches kept for replay
    hwm: int = 100_000              # the PUB socket's high-water mark
    max_queue_size: int = 100_000   # batches waiting for the publisher thread; more are dropped
    topic: str = ""


_TYPES = {"enable_kv_cache_events": (bool,), "publisher": (str,), "endpoint": (str,),
          "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,),
          "max_queue_size": (int,), "topic": (str,)}
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


def parse_config(text: str | None) -> KVEventsConfig | None:
    """The flag's JSON checked: None when events are off (no flag, enable_kv_cache_events false
    or the "null" publisher), else the config; a one-line UserError naming what is wrong."""
    if text is None or not text.strip():
        return None
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{_FLAG}: not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(given, dict):
        raise UserError(f"{_FLAG}: expected a JSON object, got {type(given).__name__}")
    known = [f.name for f in fields(KVEventsConfig)]
    for key, value in given.items():
        if key not in _TYPES:
            raise UserError(f"{_FLAG}: unknown key {key!r} (known: {', '.join(known)})")
        kinds = _TYPES[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise UserError(f"{_FLAG}: {key} must be {' or '.join(_type_name(k) for k in kinds)}"
                            f", got {json.dumps(value)}")
    cfg = KVEventsConfig(**given)
    if cfg.publisher not in ("zmq", "null"):
        raise UserError(f"{_FLAG}: publisher must be \"zmq\" or \"null\", got {cfg.publisher!r}")
    for key in ("endpoint", "replay_endpoint"):
        value = getattr(cfg, key)
        if value is not None and not value.startswith(_ENDPOINT_SCHEMES):
            raise UserError(f"{_FLAG}: {key} must be a tcp://, ipc:// or inproc:// address, "
                            f"got {value!r}")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(cfg, key) < 1:
            raise UserError(f"{_FLAG}: {key} must be >= 1, got {getattr(cfg, key)}")
    if not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return None
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise UserError(f"{_FLAG}: KV events need pyzmq and msgspec ({e.name} is missing): "
                        "pip install 'maxjax[kv-events]'") from None
    return cfg


def _type_name(kind) -> str:
    return {bool: "true or false", str: "a string", int: "an integer",
            type(None): "null"}[kind]


def start(text: str | None, block_manager, page_size: int, data_parallel_rank: int = 0):
    """The events' recorder on `block_manager` with its publisher thread running (None when
    events are off). The engine calls its `flush` after each step and `close` at shutdown."""
    cfg = parse_config(text)
    if cfg is None:
        return None
    from maxjax.engine.kv_events_zmq import Recorder, ZmqPublisher
    try:
        publisher = ZmqPublisher(cfg, data_parallel_rank)
    except Exception as e:     # zmq.ZMQError: the address is taken, or cannot be resolved
        raise UserError(f"{_FLAG}: cannot open {cfg.endpoint}: {e}") from None
    recorder = Recorder(publisher, page_size)
    block_manager.listener = recorder
    return recorder
