"""The compiled program: one step graph per bucket, and one sampler graph per number of sample
slots, run one after the other on the device (`SampledStep`).

`step_program` is the function every step executable runs, `sample_program` every sampler's;
`step_graph_specs` and `sampler_specs` give, for a bucket set, everything needed to trace,
compile or export each graph (function, abstract arguments, donated arguments) without
allocating anything; `kv_init_spec` is the one more graph that makes the zero KV pool on the
device (so a server from artifacts compiles nothing, not even zeros). Every graph returns
(outputs, kv). The engine's ModelRunner compiles these specs (or loads them from artifacts,
maxjax/aot/), and AOT export reads them from here and nowhere else.

Step: (params, kv, step: StepInputs) -> ((logits f32[S, V] of the sample slots, PromptLogprobs,
PooledHidden), kv) with the KV pool donated. Sampler: (logits, samp: SamplingArrays) ->
(SampleOutput, ()). The sampler is a graph of its own because it is most of a small model's
compile time (XLA:CPU: 4 tiny step graphs compile in 5.6-6.7 s with it, 2.2 s without) and the
same for every bucket with its number of slots and every model with its vocabulary: the
buckets share one, and the compile cache shares it across engines (maxjax/aot/cache.py Donors).
Logits never leave the device: only the sample slots' token ids and logprobs (and, in steps that
ask, prompt logprobs and the rows' pooled hidden states) come back.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from maxjax.graphs import quant, sampling, sharding, snapshots
from maxjax.graphs.attention import AttentionBackend, backend_named
from maxjax.graphs.decoder import init_kv, kv_pool_specs, kv_specs
from maxjax.graphs.state import request_state_of, state_of
from maxjax.graphs.step import step_input_specs

KV_DONATED = (1,)     # argument index of the KV pool in step_program(params, kv, step)
KV_INIT = "kv_init"   # the graph that makes a zero KV pool
STEP_ARGS = ("params", "kv", "step")        # what a graph's arguments are called in a manifest
SAMPLE_ARGS = ("logits", "sampling")


class PromptLogprobs(NamedTuple):
    logprobs: jax.Array       # f32[T]: logprob of step.next_token after each slot
    top_ids: jax.Array        # i32[T, K]
    top_logprobs: jax.Array   # f32[T, K]


class PooledHidden(NamedTuple):
    """Per request row, of this step's tokens of that row: what embedding requests are made of
    (the host sums `total` over a prompt's chunks for mean pooling, keeps `last` of its last
    chunk for last-token pooling). Final-normed hidden states, f32[R, hidden] each: the same
    few KB whatever the token bucket, so no [T, hidden] array leaves the device."""
    total: jax.Array      # f32[R, H] sum over the row's tokens in this step
    last: jax.Array       # f32[R, H] at the row's last token in this step (0: no tokens)
    # [T, H] every token slot's, kept on the device for the MTP draft (graphs/mtp.py); None:
    # not asked (`step_program`'s `hidden`)
    hidden: Any = None


@dataclass(frozen=True)
class GraphSpec:
    """Everything needed to trace, export or compile one graph, without running it."""
    name: str
    bucket: Any              # maxjax.engine.buckets.Bucket: num_tokens, num_rows, num_samples
    fn: Callable
    args: tuple              # pytree of jax.ShapeDtypeStruct
    donate_argnums: tuple
    out_shardings: Any = None   # on a mesh: (outputs', kv's) shardings; None: one device
    returns_kv: bool = True     # False: its (outputs, kv) has no kv (an image encoder, a sampler)
    arg_names: tuple = STEP_ARGS


def step_program(arch, cfg, num_top_logprobs: int, params, kv, step, hidden: bool = False):
    """The compiled step: model, the sample slots' logits (float32, for the sampler graph), and
    (only in steps that ask) prompt logprobs of every token slot. A hybrid model's state
    snapshots are restored before it and saved after it (graphs/snapshots.py). `hidden`: the
    outputs keep every slot's hidden state too (PooledHidden.hidden, for the MTP draft)."""
    kv = snapshots.restore(cfg, kv, step)
    if arch.hidden_states is None:     # an architecture without hidden states: no embeddings
        logits, kv = arch.forward(cfg, params, kv, step)
        R, H = step.page_table.shape[0], cfg.hidden_size
        zeros = jnp.zeros((R, H), jnp.float32)
        return (logits.astype(jnp.float32), _no_prompt_logprobs(step, num_top_logprobs),
                PooledHidden(zeros, zeros)), snapshots.save(cfg, kv, step)
    h, kv = arch.hidden_states(cfg, params, kv, step)
    kv = snapshots.save(cfg, kv, step)
    logits = arch.lm_logits(cfg, params, h[step.sample_idx]).astype(jnp.float32)

    def prompt_lps(h):
        lps = sampling.token_logprobs(arch.lm_logits(cfg, params, h),
                                      jnp.maximum(step.next_token, 0), num_top_logprobs)
        return PromptLogprobs(*lps)

    plp = jax.lax.cond(jnp.any(step.next_token >= 0), prompt_lps,
                       lambda h: _no_prompt_logprobs(step, num_top_logprobs), h)
    pooled = pool_rows(h, step)
    if hidden:
        pooled = pooled._replace(hidden=h.astype(params["final_norm"].dtype))
    return (logits, plp, pooled), kv


def sample_program(num_top_logprobs: int, logits, samp):
    """The compiled sampler: the sample slots' tokens (and logprobs) from their logits."""
    return sampling.sample_logits(logits, samp, num_top_logprobs), ()


def sampled_step(arch, cfg, num_top_logprobs: int, params, kv, step, samp):
    """`step_program` then `sample_program` as one function (one jit): what a bucket's two
    graphs compute, for benchmarks and tests that trace a whole step."""
    (logits, plp, pooled), kv = step_program(arch, cfg, num_top_logprobs, params, kv, step)
    return (sample_program(num_top_logprobs, logits, samp)[0], plp, pooled), kv


class SampledStep:
    """What ModelRunner calls for a bucket: (params, kv, step, samp) -> ((SampleOutput,
    PromptLogprobs, PooledHidden), kv), its step graph then its sampler graph (both queued
    on the device before anything comes back)."""

    def __init__(self, step: Callable, sample: Callable):
        self.step = step
        self.sample = sample

    @property
    def source(self) -> str:
        """How the step graph was obtained (maxjax/aot/graphs.py StepCallable), "jit" here."""
        return getattr(self.step, "source", "jit")

    def __call__(self, params, kv, step, samp):
        (logits, plp, pooled), kv = self.step(params, kv, step)
        out, _ = self.sample(logits, samp)
        return (out, plp, pooled), kv


def sampler_name(num_samples: int) -> str:
    return f"sample_s{num_samples}"


def sampled_steps(buckets: Sequence, graphs: dict, wrap_step=None, wrap_sampler=None) -> dict:
    """{Bucket: SampledStep} from {graph name: executable} holding each bucket's step graph and
    sampler; `wrap_step`/`wrap_sampler` make the callables (applied once per graph, so the
    buckets with one number of sample slots share one sampler)."""
    names = {sampler_name(b.num_samples) for b in buckets}
    samplers = {n: wrap_sampler(graphs[n]) if wrap_sampler else graphs[n] for n in names}
    return {b: SampledStep(wrap_step(graphs[b.name]) if wrap_step else graphs[b.name],
                           samplers[sampler_name(b.num_samples)]) for b in buckets}


def pool_rows(h, step) -> PooledHidden:
    """Each row's sum and last hidden state over its token slots (`step.token_row`). The sum is
    a one-hot [R, T] x [T, H] matmul at full f32 precision (a GPU would otherwise take it in
    TF32); padding slots (row -1) are in no row."""
    T, R = h.shape[0], step.page_table.shape[0]
    in_row = step.token_row[None, :] == jnp.arange(R, dtype=jnp.int32)[:, None]     # [R, T]
    hf = h.astype(jnp.float32)
    total = jnp.dot(in_row.astype(jnp.float32), hf, precision=jax.lax.Precision.HIGHEST)
    last_slot = jnp.max(jnp.where(in_row, jnp.arange(T, dtype=jnp.int32)[None, :], -1), axis=1)
    last = jnp.where((last_slot >= 0)[:, None], hf[jnp.maximum(last_slot, 0)], 0.0)
    return PooledHidden(total, last)


def _no_prompt_logprobs(step, k: int) -> PromptLogprobs:
    return PromptLogprobs(*sampling.no_logprobs(step.token_ids.shape[0], k))


def abstract(tree):
    """ShapeDtypeStructs of a pytree of arrays (or of ShapeDtypeStructs)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def step_graph_specs(arch, cfg, params, kv, buckets: Sequence, max_pages: int,
                     num_top_logprobs: int, backend: AttentionBackend | None = None,
                     mesh=None, hidden: bool = False) -> list[GraphSpec]:
    """One GraphSpec per bucket. `params` and `kv` may be real arrays or abstract ones (params
    with a "lora" entry, graphs/lora.py, take a per-token adapter slot input);
    `backend`: the attention backend (graphs/attention.py; None: the default platform's);
    `mesh`: the tensor-parallel mesh the graphs are sharded over (None: one device); `hidden`:
    the steps return every slot's hidden state (`step_program`)."""
    fn = partial(step_program, arch, cfg, num_top_logprobs, hidden=hidden)
    params, kv = abstract(params), abstract(kv)
    out_shardings = None
    if mesh is not None:
        if mesh.size == 1:      # whole (a replica's one device; CPU-kernel packed params too)
            params = _on(params, sharding.replicated(mesh))
        else:
            specs = quant.param_specs(arch.param_specs(cfg), params)
            params = _on(params, sharding.shardings(specs, mesh, sharding.mesh_rules(cfg, mesh)))
        kv_sh = _kv_shardings(cfg, kv[0].shape[1], kv[0].shape[3], mesh, state_slots(cfg, kv))
        kv, out_shardings = _on(kv, kv_sh), (sharding.replicated(mesh), kv_sh)
    specs = []
    for b in sorted(buckets):
        step = step_input_specs(b.num_tokens, b.num_rows, max_pages, b.num_samples, backend,
                                lora="lora" in params, embeds=image_embeds(cfg, params),
                                mrope=cfg.mrope_section is not None,
                                state=request_state_of(cfg) is not None)
        if mesh is not None:      # per-step inputs are replicated: every device reads them whole
            step = _on(step, sharding.replicated(mesh))
        specs.append(GraphSpec(b.name, b, fn, (params, kv, step), KV_DONATED, out_shardings))
    return specs


def sampler_specs(cfg, buckets: Sequence, history_len: int, num_top_logprobs: int,
                  mesh=None) -> list[GraphSpec]:
    """One sampler GraphSpec per number of sample slots among `buckets`, replicated over `mesh`
    when given (every device samples the whole logits)."""
    fn = partial(sample_program, num_top_logprobs)
    specs = []
    for S in sorted({b.num_samples for b in buckets}):
        args = (jax.ShapeDtypeStruct((S, cfg.vocab_size), jnp.float32),
                sampling.SamplingArrays.abstract(S, history_len, cfg.vocab_size))
        out = None
        if mesh is not None:
            args, out = _on(args, sharding.replicated(mesh)), (sharding.replicated(mesh), ())
        specs.append(GraphSpec(sampler_name(S), None, fn, args, (), out, returns_kv=False,
                               arg_names=SAMPLE_ARGS))
    return specs


def image_embeds(cfg, params) -> tuple | None:
    """(hidden size, dtype) of the image embeddings a step takes (graphs/step.py); None: the
    model reads no images. Their dtype is the activations' (the final norm's)."""
    if cfg.image_token_id is None:
        return None
    return cfg.hidden_size, params["final_norm"].dtype


def state_slots(cfg, kv) -> int:
    """The request-state slots of a pool pytree (graphs/state.py: after the paged pools, each
    [state layers, slots, ...]); 0 for a model without state layers."""
    return kv[-1].shape[1] if request_state_of(cfg) is not None else 0


def _kv_shardings(cfg, num_pages: int, page_size: int, mesh, slots: int = 0):
    rules = sharding.mesh_rules(cfg, mesh)
    return sharding.shardings(kv_pool_specs(cfg, num_pages, page_size, slots), mesh, rules)


def _on(tree, shardings):
    """ShapeDtypeStructs of `tree` placed by `shardings` (a matching pytree, or one sharding)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings),
                            tree)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                        shardings)


def kv_init_spec(cfg, num_pages: int, page_size: int, dtype, mesh=None,
                 attention: str | None = None, state_slots: int = 0,
                 state_dtype=None) -> GraphSpec:
    """() -> (None, a zero KV pool), sharded on kv heads over `mesh` when given, its paged
    pools made by the attention backend's `zero_pool` when it has one (`attention`: its name);
    a hybrid model's request-state pools of `state_slots` slots in `state_dtype` after them."""
    def kv_init():
        zero = attention and backend_named(attention).zero_pool
        if zero:
            specs = kv_specs(cfg, num_pages, page_size, dtype, state_slots, state_dtype)
            n = len(state_of(cfg).pools(cfg))
            return None, zero(specs[:n]) + tuple(jnp.zeros(s.shape, s.dtype) for s in specs[n:])
        return None, init_kv(cfg, num_pages, page_size, dtype, state_slots, state_dtype)
    out = None if mesh is None else (
        sharding.replicated(mesh), _kv_shardings(cfg, num_pages, page_size, mesh, state_slots))
    return GraphSpec(KV_INIT, None, kv_init, (), (), out)


def jit_kwargs(spec: GraphSpec) -> dict:
    """jax.jit's keywords for `spec`: its donation, and its output shardings on a mesh."""
    kw = {"donate_argnums": spec.donate_argnums}
    if spec.out_shardings is not None:
        kw["out_shardings"] = spec.out_shardings
    return kw
