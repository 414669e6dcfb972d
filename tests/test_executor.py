"""ModelRunner's step result and its executor seam (maxjax/engine/executor.py), over stand-in
executables (no compile): `run` returns the rows, the bucket and the timing; a multi-host
leader's executor sends each call over the plan channel's wire format, and a follower's loop
hands it to its own LocalExecutor, which makes the same calls with the same outputs."""
import dataclasses
import socket
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from maxjax.engine import distributed
from maxjax.engine.buckets import Bucket
from maxjax.engine.executor import LocalExecutor
from maxjax.engine.runner import ModelRunner, RowRequest, StepResult
from maxjax.engine.types import MAX_TOP_LOGPROBS, SamplingParams
from maxjax.graphs import sampling
from maxjax.graphs.config import ModelConfig
from maxjax.graphs.step import RowSlice, build_step_inputs

CFG = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 4, 2, 8)
MODEL = SimpleNamespace(config=CFG, params={})
BUCKETS = [Bucket(4, 2), Bucket(8, 2)]
PAGE, MAX_PAGES, HISTORY = 4, 2, 16


def stand_in(calls: list):
    """A step executable: each sample slot's token + 10 x (steps since the pool was made), so
    the outputs follow the pool's history; every call is recorded."""
    def exe(params, kv, step, samp):
        (n,) = kv
        ids = (np.asarray(step.token_ids)[np.asarray(step.sample_idx)] + 10 * n).astype(np.int32)
        S, T, K = len(ids), len(step.token_ids), MAX_TOP_LOGPROBS
        out = (ids, np.zeros(S, np.float32), np.zeros((S, K), np.int32),
               np.zeros((S, K), np.float32))
        plp = (np.zeros(T, np.float32), np.zeros((T, K), np.int32), np.zeros((T, K), np.float32))
        pooled = (np.zeros((2, CFG.hidden_size), np.float32),) * 2
        calls.append((step.bucket, ids))
        return (out, plp, pooled), (n + 1,)
    return exe


def make_runner(calls, executor=None) -> ModelRunner:
    exe = stand_in(calls)
    return ModelRunner(MODEL, BUCKETS, 8, PAGE, MAX_PAGES, HISTORY,
                       executables={b: exe for b in BUCKETS}, kv_init=lambda: (0,),
                       executor=executor)


def rows(*prompts) -> list[RowRequest]:
    return [RowRequest(RowSlice(p, 0, [1 + 2 * i, 2 + 2 * i]), SamplingParams(temperature=0.0), p, [], 0)
            for i, p in enumerate(prompts)]


def test_run_returns_the_rows_bucket_and_timing():
    calls = []
    r = make_runner(calls)
    res = r.run(rows([1, 2, 3], [4, 5]))
    assert isinstance(res, StepResult) and res.bucket == Bucket(8, 2)
    assert [x.token_ids for x in res.rows] == [[3], [5]]
    assert set(res.timing) == {"build_inputs", "device_step"}
    assert all(v >= 0 for v in res.timing.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.bucket = None
    assert r.run(rows([7], [8])).bucket == Bucket(4, 2)
    assert not hasattr(r, "last_bucket") and not hasattr(r, "last_timing")


def test_a_reset_pool_goes_through_the_executor():
    r = make_runner([])
    r.run(rows([1]))
    assert r.kv == (1,)
    r.reset_kv()
    assert r.kv == (0,) and r.run(rows([1])).rows[0].token_ids == [1]


class FakeChannel:
    """Both ends of a plan channel in one process: the wire format over a socket pair."""

    def __init__(self):
        self.a, self.b = socket.socketpair()
        self.sent = []

    def broadcast(self, header, arrays=()):
        self.sent.append(header["op"])
        distributed._send(self.a, header, arrays)

    def recv(self):
        return distributed._recv(self.b)


def structures(r: ModelRunner) -> list:
    """Per bucket, the tree of its (step, samp) inputs."""
    return [jax.tree.structure((
        build_step_inputs([], b.num_tokens, b.num_rows, MAX_PAGES, PAGE, b.num_samples,
                          r.attention),
        sampling.build_sampling_arrays([], b.num_samples, HISTORY, r.eos, CFG.vocab_size)))
        for b in r.buckets]


def test_a_follower_makes_the_leaders_calls_with_the_same_outputs():
    channel, led, followed = FakeChannel(), [], []
    leader = make_runner(led, lambda local: distributed.LeaderExecutor(channel, local))
    results = [leader.run(rows([1, 2, 3], [4, 5])), leader.run(rows([6], [7]))]
    leader.reset_kv()
    results.append(leader.run(rows([9, 9, 9, 9, 9])))
    channel.broadcast({"op": "stop"})
    assert channel.sent == ["step", "step", "kv_init", "step", "stop"]
    assert [[x.token_ids for x in res.rows] for res in results] == [[[3], [5]], [[16], [17]],
                                                                     [[9]]]
    exe = stand_in(followed)
    local = LocalExecutor(BUCKETS, {b: exe for b in BUCKETS}, lambda: (0,), dict)
    assert distributed.follow(channel, local, structures(leader)) == 0
    assert len(followed) == len(led) == 3
    for (fb, fids), (lb, lids) in zip(followed, led):
        assert fb == lb
        np.testing.assert_array_equal(fids, lids)
    assert local.kv == leader.kv == (1,)


def test_the_pool_is_made_before_the_executor_exists():
    """An engine is ready when its pool is: on a mesh XLA:CPU makes a pool asynchronously (GiBs
    for seconds), and a start that did not wait said ready while its first step still waited
    (maxjax/engine/executor.py). Here 256 MiB on each of two devices, ~0.1 s."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    whole = NamedSharding(mesh, PartitionSpec())
    make = jax.jit(lambda: (jax.numpy.zeros(1 << 26, np.float32),), out_shardings=(whole,))
    jax.block_until_ready(make())               # compiled before
    local = LocalExecutor(BUCKETS, {}, make, lambda: {})
    assert all(a.is_ready() for a in local.kv)
    local.init_kv()
    assert all(a.is_ready() for a in local.kv)
