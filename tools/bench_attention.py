"""The SmolLM2 step (random f32 weights, greedy) on attention-heavy mixes, optionally against the
paged attention of another git revision, interleaved in one process: this machine's speed drifts
by up to ~25% over minutes, so separate runs cannot resolve a 10% change. A revision's attention
is graphs/attention.py `query_block_attention`, or, before that file existed, graphs/layers.py
`paged_attention` (which read the query blocks from the step itself).

    .venv/bin/python tools/bench_attention.py [--against REV] [--iters 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import types

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_step import ARCH, SMOLLM2  # noqa: E402

from maxjax.graphs import sampling  # noqa: E402
from maxjax.graphs.program import step_program  # noqa: E402
from maxjax.engine.types import SamplingParams  # noqa: E402
from maxjax.graphs import attention, decoder  # noqa: E402
from maxjax.graphs.step import RowSlice, build_step_inputs  # noqa: E402

PAGE, POOL_PAGES, MAX_PAGES = 32, 400, 128


def decodes(n: int, ctx: int, first_page: int = 1) -> list[RowSlice]:
    per = -(-(ctx + 1) // PAGE)
    return [RowSlice([5], ctx, list(range(first_page + per * i, first_page + per * (i + 1))))
            for i in range(n)]


CASES = {   # name: (rows, bucket T, bucket R)
    "decode 32 rows, 256 context": (decodes(32, 256), 32, 32),
    "decode 31 x 100 + 1 x 2000 context": (decodes(31, 100) + decodes(1, 2000, 200), 32, 32),
    "prefill 128 in (128, 32)": ([RowSlice([5] * 128, 0, list(range(1, 5)))], 128, 32),
    "30 decodes + 2 x 113 prefill": (decodes(30, 200) + [
        RowSlice([5] * 113, 0, list(range(300, 304))), RowSlice([5] * 113, 0, list(range(310, 314)))],
        256, 32),
}


def _module_at(rev: str, path: str):
    src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if src.returncode:
        return None
    file = os.path.join(tempfile.mkdtemp(), "attention_at_rev.py")
    with open(file, "w") as f:
        f.write(src.stdout)
    spec = importlib.util.spec_from_file_location("attention_at_rev", file)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def attention_at(rev: str):
    mod = _module_at(rev, "graphs/attention.py")
    if mod is not None:
        return mod.query_block_attention
    old = _module_at(rev, "graphs/layers.py").paged_attention

    def flat(q, k_pool, v_pool, layer, step, window, scale, softcap=None):
        fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
        fields.update({f.name: getattr(step.attn, f.name) for f in dataclasses.fields(step.attn)})
        return old(q, k_pool, v_pool, layer, types.SimpleNamespace(**fields), window, scale, softcap)
    return flat


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", help="git revision whose graphs/layers.py paged_attention to compare")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    impls = {"current": attention.query_block_attention}
    if args.against:
        impls[args.against] = attention_at(args.against)
    cfg = SMOLLM2
    key = jax.random.PRNGKey(0)
    params = jax.tree.map(lambda s: jax.random.normal(key, s.shape, s.dtype) * 0.02,
                          decoder.abstract_params(cfg, jnp.float32))
    kv = decoder.init_kv(cfg, POOL_PAGES, PAGE, jnp.float32)
    inputs, exes = {}, {}
    for case, (rows, T, R) in CASES.items():
        inputs[case] = (build_step_inputs(rows, T, R, MAX_PAGES, PAGE),
                        sampling.build_sampling_arrays(
                            [(SamplingParams(temperature=0.0), [1], [], 0)] * len(rows), R, 64,
                            vocab_size=cfg.vocab_size))
    for name, fn in impls.items():
        # read when the step is traced
        attention.BACKENDS[attention.QUERY_BLOCKS.name] = dataclasses.replace(
            attention.QUERY_BLOCKS, attend=fn)
        step = jax.jit(lambda p, kv, st, sa: step_program(ARCH, cfg, 20, p, kv, st, sa),
                       donate_argnums=(1,))
        for case, (st, sa) in inputs.items():
            exes[name, case] = step.lower(params, kv, st, sa).compile()
    times = {k: [] for k in exes}
    for _ in range(args.iters + 1):            # the first round is not counted
        for case, (st, sa) in inputs.items():
            for name in impls:
                t = time.perf_counter()
                out, kv = exes[name, case](params, kv, st, sa)
                jax.block_until_ready(out)
                times[name, case].append(time.perf_counter() - t)
    names = list(impls)
    print("| case | " + " | ".join(f"{n} ms" for n in names) + (" | ratio |" if len(names) > 1 else " |"))
    print("|---" * (len(names) + 1 + (len(names) > 1)) + "|")
    for case in CASES:
        ms = [float(np.median(times[n, case][1:]) * 1e3) for n in names]
        ratio = f" | {ms[0] / ms[1]:.2f}x" if len(ms) > 1 else ""
        print(f"| {case} | " + " | ".join(f"{m:.1f}" for m in ms) + ratio + " |")


if __name__ == "__main__":
    main()
