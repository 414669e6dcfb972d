"""Several processes, one engine: `--coordinator-address HOST:PORT --num-processes N
--process-id I` (else JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).

Every process joins `jax.distributed` (gloo collectives on the CPU, NCCL on GPUs), loads the
model, places its params on the one mesh over all processes' devices (maxjax/engine/devices.py:
each process holds only its shards on its devices) and compiles the same graphs; or, with
`--precompiled-artifacts` of the group's warm-cache (maxjax/aot/group.py), restores its shards
of the stored weights and loads its own executables. Process 0 runs
the HTTP server and the scheduler; its ModelRunner's executor (`LeaderExecutor`) sends each call
of a step executable (and of the KV initializer when a pool is replaced), the bucket and the
step's input arrays, to every other process before making it; their `follow` loop hands the call
to their own runner's executor (maxjax/engine/executor.py): every process runs every step in
lockstep with the same bucket, and the collectives XLA inserted join them.

The plan channel is one TCP connection from each process to process 0 at HOST:PORT+1 (the
coordinator holds PORT). A message is a JSON header and raw array bytes: nothing received is
unpickled or run. Process 0 first sends the layout it planned (the pool size follows free
memory, which differs between hosts). A connection that closes means its process ended: process
0 logs which and exits 1 at once, since a collective would wait for the dead process forever;
the others exit 1 when process 0's connection closes (0 after its "stop").
"""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from maxjax.engine.executor import LocalExecutor, StepExecutor
from maxjax.errors import UserError

log = logging.getLogger("maxjax.distributed")
CONNECT_TIMEOUT = 120.0
_LEN = struct.Struct("<Q")


@dataclass
class DistributedOptions:
    coordinator_address: str | None = field(default=None, metadata={
        "help": "HOST:PORT of process 0's jax.distributed coordinator (the plan channel uses "
                "PORT+1); default: $JAX_COORDINATOR_ADDRESS"})
    num_processes: int | None = field(default=None, metadata={
        "help": "Processes (hosts) running this engine together; default: $JAX_NUM_PROCESSES"})
    process_id: int | None = field(default=None, metadata={
        "help": "This process's rank; 0 serves HTTP and schedules; default: $JAX_PROCESS_ID"})

    def resolved(self) -> DistributedOptions | None:
        """With the environment's values filled in; None for a single process."""
        env = os.environ.get
        addr = self.coordinator_address or env("JAX_COORDINATOR_ADDRESS")
        n = self.num_processes if self.num_processes is not None else _int(env("JAX_NUM_PROCESSES"))
        i = self.process_id if self.process_id is not None else _int(env("JAX_PROCESS_ID"))
        if addr is None and n in (None, 1) and i in (None, 0):
            return None
        if addr is None or n is None or i is None:
            raise UserError("multi-host needs --coordinator-address, --num-processes and "
                            "--process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                            "JAX_PROCESS_ID)")
        if n < 1 or not 0 <= i < n:
            raise UserError(f"--process-id {i} is not in 0..{n - 1} (--num-processes {n})")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise UserError(f"--coordinator-address {addr!r}: expected HOST:PORT")
        return DistributedOptions(addr, n, i)

    @property
    def plan_address(self) -> tuple[str, int]:
        host, _, port = self.coordinator_address.rpartition(":")
        return host, int(port) + 1


def _int(text):
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"not a number in the environment: {text!r}") from None


def initialize(opts: DistributedOptions) -> None:
    """Join the group (before anything starts a JAX backend)."""
    import jax
    if (jax.config.jax_platforms or "cpu").split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("joining %d processes at %s as process %d", opts.num_processes,
             opts.coordinator_address, opts.process_id)
    jax.distributed.initialize(opts.coordinator_address, opts.num_processes, opts.process_id,
                               initialization_timeout=int(CONNECT_TIMEOUT),
                               heartbeat_timeout_seconds=10)


# ---- wire format ---------------------------------------------------------------------------------
def _send(sock: socket.socket, header: dict, arrays=()) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = {**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
    head = json.dumps(header).encode()
    sock.sendall(b"".join([_LEN.pack(len(head)), head, *(a.tobytes() for a in arrays)]))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[dict, list[np.ndarray]]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    header = json.loads(_recv_exact(sock, n))
    arrays = []
    for dtype, shape in header.pop("arrays"):
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ConnectionError("object arrays are not accepted")
        size = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(_recv_exact(sock, size), dt).reshape(shape))
    return header, arrays


def _fatal(message: str) -> None:
    log.error(message)
    print(f"maxjax: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


# ---- process 0 -----------------------------------------------------------------------------------
class Leader:
    """Process 0's end of the plan channel."""

    def __init__(self, opts: DistributedOptions):
        self.opts = opts
        self.closing = False
        self.conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        host, port = opts.plan_address
        srv = socket.create_server((host, port), reuse_port=False)
        srv.settimeout(CONNECT_TIMEOUT)
        try:
            while len(self.conns) < opts.num_processes - 1:
                conn, _ = srv.accept()
                conn.settimeout(CONNECT_TIMEOUT)
                hello, _ = _recv(conn)
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.conns[int(hello["process_id"])] = conn
        except socket.timeout:
            missing = sorted(set(range(1, opts.num_processes)) - set(self.conns))
            raise UserError(f"processes {missing} did not connect to {host}:{port} within "
                            f"{CONNECT_TIMEOUT:.0f} s") from None
        finally:
            srv.close()
        for i, conn in self.conns.items():
            threading.Thread(target=self._watch, args=(i, conn), daemon=True,
                             name=f"maxjax-watch-{i}").start()

    def _watch(self, i: int, conn: socket.socket) -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        if not self.closing:
            _fatal(f"process {i} of {self.opts.num_processes} left the group (its connection "
                   f"to {self.opts.plan_address[0]} closed): stopping, since every step needs "
                   "every process")

    def broadcast(self, header: dict, arrays=()) -> None:
        with self._lock:
            for i, conn in self.conns.items():
                try:
                    _send(conn, header, arrays)
                except OSError as e:
                    _fatal(f"process {i} of {self.opts.num_processes} left the group ({e})")

    def send_layout(self, pins: dict, artifacts: bool = False) -> None:
        """Process 0's planned pool size and max length (none when artifacts pin them)."""
        self.broadcast({"op": "layout", **pins, "artifacts": artifacts})

    def close(self) -> None:
        self.closing = True
        self.broadcast({"op": "stop"})
        for conn in self.conns.values():
            conn.close()


# ---- the other processes -------------------------------------------------------------------------
class Follower:
    def __init__(self, opts: DistributedOptions):
        self.opts = opts
        host, port = opts.plan_address
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise UserError(f"process 0's plan channel {host}:{port} did not answer "
                                    f"within {CONNECT_TIMEOUT:.0f} s") from None
                time.sleep(0.2)
        self.sock.settimeout(None)
        _send(self.sock, {"op": "hello", "process_id": opts.process_id})

    def recv(self) -> tuple[dict, list[np.ndarray]]:
        try:
            return _recv(self.sock)
        except (OSError, ConnectionError, ValueError) as e:
            _fatal(f"process {self.opts.process_id}: process 0 left the group ({e}): stopping")
            raise

    def receive_layout(self, artifacts: bool = False) -> dict:
        header, _ = self.recv()
        if header.get("op") != "layout":
            _fatal(f"process {self.opts.process_id}: expected the layout, got {header.get('op')}")
        if bool(header.get("artifacts")) != artifacts:
            _fatal(f"process {self.opts.process_id}: --precompiled-artifacts is "
                   f"{'given' if artifacts else 'not given'} here but "
                   f"{'is' if header.get('artifacts') else 'is not'} on process 0: every "
                   "process of a group serves from the same artifacts, or none does")
        from maxjax.engine.plan import PINNED_FIELDS
        return {k: header[k] for k in PINNED_FIELDS if header.get(k) is not None}


# ---- the executor seam's two ends ----------------------------------------------------------------
class LeaderExecutor:
    """Process 0's runner executor: sends each call to the other processes, then makes it
    here. `channel`: what `broadcast`s a message (a Leader)."""

    def __init__(self, channel, local: LocalExecutor):
        self.channel = channel
        self.local = local

    @property
    def kv(self) -> tuple:
        return self.local.kv

    def run(self, bucket_index: int, step, samp):
        import jax
        leaves = [np.asarray(a) for a in jax.tree.leaves((step, samp))]
        self.channel.broadcast({"op": "step", "bucket": bucket_index}, leaves)
        return self.local.run(bucket_index, step, samp)

    def init_kv(self) -> None:
        self.channel.broadcast({"op": "kv_init", "bucket": None})
        self.local.init_kv()


def follow(channel, executor: StepExecutor, structures) -> int:
    """Hand process 0's calls, as `channel.recv()` gives them, to this process's `executor`
    until it says stop. `structures`: per bucket index, the tree of its (step, samp) inputs."""
    import jax
    while True:
        header, arrays = channel.recv()
        op = header["op"]
        if op == "stop":
            return 0
        if op == "kv_init":
            executor.init_kv()
        elif op == "step":
            b = header["bucket"]
            executor.run(b, *jax.tree.unflatten(structures[b], arrays))
        else:
            _fatal(f"unknown plan message from process 0: {op!r}")


# ---- building the engine of a group --------------------------------------------------------------
def build_group_core(model_opts, engine_cfg, channel: Leader | Follower, progress: bool = True):
    """This process's EngineCore of the group: the model on the mesh over every process's
    devices (its shards restored from --precompiled-artifacts when they store them), the layout
    process 0 planned (or the artifacts pinned: every process adopts the same values from the
    same manifest), the graphs loaded from the artifacts or from this process's compile cache
    entry, or compiled here (no collective runs while compiling: a process that compiles while
    another loads does not hold the group up beyond its compile time)."""
    from maxjax.engine.build import build_core, load, on_devices
    from maxjax.engine.plan import plan_engine, prepare, replica_mesh
    if model_opts.export_artifacts:
        raise UserError("--export-artifacts with --num-processes: not supported (every process "
                        "runs `maxjax warm-cache` with the group flags instead)")
    if engine_cfg.data_parallel_degree > 1:
        raise UserError("--data-parallel-degree with --num-processes: not supported yet (run "
                        "one group per replica behind a load balancer)")
    artifacts = model_opts.precompiled_artifacts
    # The mesh spans the processes: the CPU kernels never run here (build_core says so).
    prepared = prepare(engine_cfg, kernels=False)
    flags = prepared.config
    model = load(model_opts.source(), prepared, model_opts.chat_template, artifacts, progress,
                 replica_mesh(flags) if artifacts else None)
    model = on_devices(model, flags)
    pins = {}
    if isinstance(channel, Leader):
        if not artifacts:       # artifacts pin the layout for every process alike
            pins = plan_engine(prepared, model).pins
        channel.send_layout(pins, bool(artifacts))
    else:
        pins = channel.receive_layout(bool(artifacts))
    leads = isinstance(channel, Leader)
    return build_core(model, engine_cfg, precompiled_artifacts=artifacts, pins=pins,
                      require_compiled=model_opts.require_compiled_artifacts, progress=progress,
                      compile_cache=model_opts.compile_cache,
                      compile_cache_max_size=model_opts.compile_cache_max_size,
                      executor=(lambda local: LeaderExecutor(channel, local)) if leads else None)


def run_follower(model_opts, engine_cfg, opts: DistributedOptions) -> int:
    """Process I > 0 of `maxjax serve`: build the same engine, then make process 0's calls."""
    follower = Follower(opts)
    core = build_group_core(model_opts, engine_cfg, follower)
    log.info("process %d of %d ready: following process 0", opts.process_id, opts.num_processes)
    return follow(follower, core.runner.executor, core.runner.input_structures())
