"""KV events on the wire, as vLLM sends them (vllm/distributed/kv_events.py and the types its
examples/online_serving/kv_events_subscriber.py copies): msgspec Structs in the array layout
(array_like, omit_defaults; each event tagged with its class name), so an event batch is the
msgpack array `[ts, [event, ...], data_parallel_rank]` and an event e.g.
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`.

One multipart message per engine step that changed the prefix cache, on a ZMQ PUB socket:
[topic, sequence number (8 bytes, big-endian), payload]. The optional replay ROUTER socket
answers a REQ carrying a start sequence number with every buffered [seq, payload] from there,
then [-1 (8 bytes, signed), b""].

What the hashes are: the BlockManager's chained page keys, as they are (ints for ahash64, bytes
for sha256 and sha256_64; vLLM's ExternalBlockHash is bytes | int). `medium` is "GPU": vLLM's
name for its device pool, sent whatever the device, since maxjax has no host tier (a router reads
"CPU" as an offload tier). `lora_id` is None: maxjax names adapters by string, vLLM's field is an
int; a LoRA request's pages hash apart from the base model's all the same.

The engine thread only appends to a list and, once a step, hands the batch to a bounded queue;
the publisher thread encodes and sends. A full queue drops the batch (`dropped` counts them) and
its sequence number goes unsent, so subscribers see the gap.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

log = logging.getLogger(__name__)

MEDIUM_DEVICE = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list
    parent_block_hash: int | bytes | None
    token_ids: list
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class Recorder:
    """The BlockManager's listener: its registrations and evictions as events, a run of pages
    of one chain (or a run of evictions) merged into one event as vLLM merges them."""

    def __init__(self, publisher: ZmqPublisher, page_size: int):
        self.publisher = publisher
        self.page_size = page_size
        self._events: list = []

    def stored(self, key, parent_key, tokens: tuple, adapter) -> None:
        last = self._events[-1] if self._events else None
        if type(last) is BlockStored and last.block_hashes[-1] == parent_key:
            last.block_hashes.append(key)
            last.token_ids.extend(tokens)
            return
        self._events.append(BlockStored([key], parent_key, list(tokens), self.page_size, None,
                                        MEDIUM_DEVICE))

    def removed(self, key) -> None:
        last = self._events[-1] if self._events else None
        if type(last) is BlockRemoved:
            last.block_hashes.append(key)
        else:
            self._events.append(BlockRemoved([key], MEDIUM_DEVICE))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def flush(self) -> None:
        """Hand this step's events to the publisher (called by the engine after each step)."""
        if self._events:
            events, self._events = self._events, []
            self.publisher.publish(EventBatch(time.time(), events))

    @property
    def dropped(self) -> int:
        return self.publisher.dropped

    def close(self) -> None:
        self.flush()
        self.publisher.close()


class ZmqPublisher:
    """vLLM's ZmqEventPublisher: a PUB socket (and a replay ROUTER) served by one thread from a
    bounded queue. Sockets are made here and used only on that thread afterwards."""

    def __init__(self, cfg, data_parallel_rank: int = 0):
        self.rank = data_parallel_rank
        self.topic = cfg.topic.encode()
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque = deque(maxlen=cfg.buffer_steps)
        self.next_seq = 0            # the sequence number of the next batch published
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(cfg.hwm)
            endpoint = offset_port(cfg.endpoint, data_parallel_rank)
            if any(s in endpoint for s in ("*", "::")) or endpoint.startswith(("ipc:", "inproc:")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(offset_port(cfg.replay_endpoint, data_parallel_rank))
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="maxjax-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Never blocks the engine: a full queue drops the batch (and its sequence number)."""
        batch.data_parallel_rank = self.rank
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV events: the publisher's queue is full; dropping event batches")

    def close(self, timeout: float = 2.0) -> None:
        try:
            self._queue.put((None, None), timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    seq, batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if seq is None:
                    return
                payload = encode(batch)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
        except Exception:
            log.exception("KV events: the publisher thread stopped")
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def offset_port(endpoint: str, rank: int) -> str:
    """A data-parallel replica's address, as vLLM's: tcp ports offset by the rank, inproc and ipc
    names suffixed."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"
