"""On-device sampling: logits of one step -> token ids (+ logprobs), part of every step graph.

Public API: `build_sampling_arrays` (host, numpy) builds the inputs of a step's sample slots;
`sample_logits(logits, arrays, num_top_logprobs)` runs inside the compiled step
(graphs/program.py) on the logits of those slots; `token_logprobs` gives the logprob (and top-k)
of given tokens. A slot is one position of one row whose next token is sampled: one per row
today, several per row for speculative decoding. Every per-request value is an array input,
so one compilation per (S slots, V, H, num_top_logprobs) serves every mix of parameters.

Order of processing, per slot ("row" below):
  1. logit_bias (sparse, added to the raw logits, OpenAI), repetition penalty (HF: positive logits
     divided, negative multiplied, for tokens seen in prompt or output), frequency/presence penalties
     (OpenAI: `-= freq * count + pres * (count > 0)` over generated tokens), suppression (-inf; used
     for EOS/stop ids while fewer than `min_tokens` tokens were generated), then the token mask
     (packed allow-bits, e.g. from a grammar: disallowed tokens get -inf; all ones when unused).
  2. logprobs are `log_softmax` of these processed logits, before temperature/top-k/top-p/min-p
     (vLLM's "processed" convention: what the model, with the user's penalties, thinks of the token).
  3. temperature, then top-k, then top-p on the top-k-renormalized distribution, then min-p
     (keep p >= min_p * p_max), then a two-level Gumbel-max draw (block, then token).

Costs measured on the 2-core dev CPU at R=32, V=49152 (XLA:CPU): a full-vocab sort is ~350 ms,
`lax.top_k(256)` ~6 ms, Gumbel noise for every logit ~100 ms, `jnp.cumsum` over V ~24 ms. Hence:
  - an all-greedy batch is an argmax (lax.cond), penalties run only when some row has one;
    `argmax` takes it in chunks of 512 (0.24 ms against jnp.argmax's 3.7 ms: XLA:CPU's
    variadic (value, index) reduce is a scalar loop);
  - top-k/top-p thresholds come from the best CANDIDATES (256) tokens (`lax.top_k`), exact whenever
    top_k <= 256 and the top-p mass is reached within them; otherwise (rare: very flat rows with top_p
    near 1, or top_k > 256) a lax.cond takes an exact bisection on the float bits of the probabilities
    (~80 ms for the batch, 32 passes over R x V). Either way the result is exact up to ties (a token tied with the threshold is kept).
  - sampling is Gumbel-max in two levels (blocks of 256 tokens, then within the block): noise for
    2 x 256 values per row instead of the vocab (the inverse CDF with one uniform it replaced
    cost as little, but its pick in a long tail moved with the last bits of the logits: a
    seeded request gave other text with the prefix cache warm, 1 prompt in 4).
Randomness: a key per row from a counter-based hash of (the request's 64-bit seed, number of
tokens generated so far), hashed with each index for the noise, so a request's samples depend only
on its seed and position, never on its batch neighbours or row (threefry would do too, but
compiles ~8x slower on XLA:CPU).

History bucket H: penalties need the prompt+output ids of each row as i32[R, H] (-1 padded), with
`output_start[R]` marking where generated tokens begin. The runner should pass H = the engine's
max_length, so a row never overflows (if it did, the oldest tokens are dropped). Cost: R*H*4 bytes per
step (32 x 4096 -> 512 KiB, tens of microseconds to copy) and an R x V scatter when some row has a
penalty; rows without penalties are left unfilled on the host.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGIT_BIAS = 64        # B: logit_bias entries per request
MAX_SUPPRESS = 16          # S: ids suppressed while min_tokens is not reached (EOS + stop_token_ids)
CANDIDATES = 256           # top-k/top-p fast path works on this many best tokens
_BLOCK = 256               # sampling block size (two-level draw)
_ARGMAX_CHUNK = 512


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling inputs for a bucket of R rows (all arrays, leading dim R)."""
    temperature: jax.Array        # f32[R], 0 = greedy
    top_k: jax.Array              # i32[R], 0 = off
    top_p: jax.Array              # f32[R], 1 = off
    min_p: jax.Array              # f32[R], 0 = off
    frequency_penalty: jax.Array  # f32[R]
    presence_penalty: jax.Array   # f32[R]
    repetition_penalty: jax.Array  # f32[R], 1 = off
    seed: jax.Array               # u32[R, 2]: (high, low) words of the request's 64-bit seed
    step: jax.Array               # i32[R]: tokens generated so far (hashed with the seed)
    bias_ids: jax.Array           # i32[R, B], -1 padded
    bias_values: jax.Array        # f32[R, B]
    suppress_ids: jax.Array       # i32[R, S], -1 padded
    history: jax.Array            # i32[R, H]: prompt then output ids, -1 padded
    output_start: jax.Array       # i32[R]: index in `history` of the first generated token
    logprobs: jax.Array           # bool[R]: the row returns logprobs (else they are skipped)
    token_mask: jax.Array         # u32[R, ceil(V/32)]: bit t % 32 of word t // 32 allows token t

    @classmethod
    def abstract(cls, R: int, history_len: int, vocab_size: int = 0) -> "SamplingArrays":
        """ShapeDtypeStructs of a bucket, for ahead-of-time lowering."""
        return _abstract(build_sampling_arrays([], R, history_len, vocab_size=vocab_size))


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


ALL_ALLOWED = np.uint32(0xFFFFFFFF)


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


class SampleSlot(NamedTuple):
    """One sampled position: its request's parameters and tokens so far, and where it is."""
    params: Any                   # maxjax.engine.types.SamplingParams (read by attribute)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]     # generated before this slot (a verified draft's slot: the
                                  # drafts before it included, offset 0)
    seed: int                     # the request's fixed 64-bit seed
    offset: int = 0               # the slot's index among its row's slots (k-th next token)
    token_mask: np.ndarray | None = None   # u32[ceil(V/32)] allow-bits; None: all allowed


class SampleOutput(NamedTuple):
    token_ids: jax.Array      # i32[R]
    logprobs: jax.Array       # f32[R]: logprob of the sampled token (processed logits, T=1)
    top_ids: jax.Array        # i32[R, K], best first
    top_logprobs: jax.Array   # f32[R, K]


# exported step/sampling graphs carry these types in their calling convention (jax.export)
jax.export.register_pytree_node_serialization(
    SamplingArrays, serialized_name="maxjax.SamplingArrays",
    serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda b: ())
jax.export.register_namedtuple_serialization(SampleOutput, serialized_name="maxjax.SampleOutput")


def build_sampling_arrays(rows: Sequence[tuple], R: int, history_len: int,
                          eos_token_ids: Sequence[int] = (), vocab_size: int = 0) -> SamplingArrays:
    """Host-side (numpy) arrays for `sample_logits`. Each row is a `SampleSlot` (or a tuple of
    its fields: params, prompt_ids, output_ids, seed[, offset, token_mask]), seed being the
    request's fixed seed (params.seed or `new_seed()` drawn at admission). Rows past len(rows) up
    to R are greedy padding. `vocab_size` sizes the token mask (0: no mask input). A request
    reaches a step only once maxjax/engine/validate.py accepted it; the size checks here keep a
    direct caller from silently losing entries."""
    if len(rows) > R:
        raise ValueError(f"{len(rows)} rows do not fit the bucket R={R}")
    H = history_len
    a = dict(
        temperature=np.zeros(R, np.float32), top_k=np.zeros(R, np.int32),
        top_p=np.ones(R, np.float32), min_p=np.zeros(R, np.float32),
        frequency_penalty=np.zeros(R, np.float32), presence_penalty=np.zeros(R, np.float32),
        repetition_penalty=np.ones(R, np.float32), seed=np.zeros((R, 2), np.uint32),
        step=np.zeros(R, np.int32),
        bias_ids=np.full((R, MAX_LOGIT_BIAS), -1, np.int32),
        bias_values=np.zeros((R, MAX_LOGIT_BIAS), np.float32),
        suppress_ids=np.full((R, MAX_SUPPRESS), -1, np.int32),
        history=np.full((R, H), -1, np.int32), output_start=np.zeros(R, np.int32),
        logprobs=np.zeros(R, np.bool_),
        token_mask=np.full((R, mask_words(vocab_size)), ALL_ALLOWED, np.uint32))
    for r, row in enumerate(rows):
        p, prompt_ids, output_ids, seed, offset, token_mask = SampleSlot(*row)
        if token_mask is not None:
            a["token_mask"][r] = token_mask
        a["temperature"][r] = 0.0 if p.greedy else p.temperature   # top_k=1: the argmax fast path
        a["top_k"][r] = p.top_k
        a["top_p"][r] = p.top_p
        a["min_p"][r] = p.min_p
        a["logprobs"][r] = p.logprobs
        a["frequency_penalty"][r] = p.frequency_penalty
        a["presence_penalty"][r] = p.presence_penalty
        a["repetition_penalty"][r] = p.repetition_penalty
        seed = int(seed) & (2**64 - 1)
        a["seed"][r] = (seed >> 32, seed & 0xFFFFFFFF)
        a["step"][r] = len(output_ids) + offset
        if p.logit_bias:
            if len(p.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries "
                                 f"(got {len(p.logit_bias)})")
            ids, vals = zip(*p.logit_bias.items())
            a["bias_ids"][r, :len(ids)] = ids
            a["bias_values"][r, :len(ids)] = vals
        if len(output_ids) + offset < p.min_tokens:
            sup = list(dict.fromkeys([*eos_token_ids, *p.stop_token_ids]))
            if len(sup) > MAX_SUPPRESS:
                raise ValueError(f"stop_token_ids: at most {MAX_SUPPRESS - len(eos_token_ids)} "
                                 f"ids with min_tokens (got {len(p.stop_token_ids)})")
            a["suppress_ids"][r, :len(sup)] = sup
        if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0:
            n_out = min(len(output_ids), H)
            n_prompt = min(len(prompt_ids), H - n_out)
            if n_prompt:
                a["history"][r, :n_prompt] = prompt_ids[len(prompt_ids) - n_prompt:]
            if n_out:
                a["history"][r, n_prompt:n_prompt + n_out] = output_ids[len(output_ids) - n_out:]
            a["output_start"][r] = n_prompt
    return SamplingArrays(**a)


def _scatter_ids(R: int, V: int, ids: jax.Array, values) -> jax.Array:
    """[R, V] array with `values` added at `ids` (-1 ids dropped)."""
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], ids.shape)
    ids = jnp.where(ids >= 0, ids, V)   # out of bounds -> dropped
    return jnp.zeros((R, V), jnp.float32).at[rows, ids].add(values, mode="drop")


def _penalize(logits: jax.Array, a: SamplingArrays) -> jax.Array:
    R, V = logits.shape
    H = a.history.shape[1]
    is_out = jnp.arange(H)[None, :] >= a.output_start[:, None]
    seen = _scatter_ids(R, V, a.history, 1.0) > 0
    counts = _scatter_ids(R, V, jnp.where(is_out, a.history, -1), 1.0)
    rp = a.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    return (logits - a.frequency_penalty[:, None] * counts
            - a.presence_penalty[:, None] * (counts > 0).astype(jnp.float32))


def process_logits(logits: jax.Array, a: SamplingArrays) -> jax.Array:
    """Bias, penalties and suppression applied to raw logits f32[R, V]."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    oob = lambda ids: jnp.where(ids >= 0, ids, V)    # -1 padding -> out of bounds -> dropped
    logits = logits.astype(jnp.float32).at[rows, oob(a.bias_ids)].add(a.bias_values, mode="drop")
    any_penalty = jnp.any((a.frequency_penalty != 0) | (a.presence_penalty != 0)
                          | (a.repetition_penalty != 1))
    logits = jax.lax.cond(any_penalty, _penalize, lambda l, _: l, logits, a)
    logits = logits.at[rows, oob(a.suppress_ids)].set(-jnp.inf, mode="drop")
    if a.token_mask.shape[1] == 0:
        return logits
    return jax.lax.cond(jnp.any(a.token_mask != ALL_ALLOWED), _apply_mask, lambda l, _: l,
                        logits, a.token_mask)


def _apply_mask(logits: jax.Array, packed: jax.Array) -> jax.Array:
    V = logits.shape[1]
    bits = (packed[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    allowed = bits.reshape(packed.shape[0], -1)[:, :V] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def _bisect_threshold(bits: jax.Array, ok_fn, hi: jax.Array) -> jax.Array:
    """Largest int t in [0, hi] with ok_fn(bits >= t) true (ok is monotone: true at t=0)."""
    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo + 1) // 2
        ok = ok_fn(bits >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    lo, _ = jax.lax.fori_loop(0, 32, body, (jnp.zeros_like(hi), hi))
    return lo


def _exact_top_p_threshold(probs: jax.Array, k: jax.Array, k_fast: jax.Array,
                           top_p: jax.Array) -> jax.Array:
    """Exact top-k then top-p probability threshold by bisection over the float bits (p >= 0, so
    the int32 bit patterns are ordered like the values). `k_fast` is the top-k threshold from the
    candidates, already exact where k <= CANDIDATES."""
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    hi = jnp.max(bits, axis=-1)
    k_fast_bits = jax.lax.bitcast_convert_type(k_fast, jnp.int32)

    def bisect_k(_):
        k_bits = _bisect_threshold(bits, lambda keep: jnp.sum(keep, -1) >= k, hi)
        return jnp.where(k > CANDIDATES, k_bits, k_fast_bits)
    k_bits = jax.lax.cond(jnp.any(k > CANDIDATES), bisect_k, lambda _: k_fast_bits, None)
    k_bits = jnp.where(k > 0, k_bits, 0)
    in_k = bits >= k_bits[:, None]
    total = jnp.sum(jnp.where(in_k, probs, 0.0), -1)
    kept_bits = jnp.where(in_k, bits, -1)
    p_bits = _bisect_threshold(kept_bits, lambda keep: jnp.sum(jnp.where(keep, probs, 0.0), -1)
                               >= top_p * total, hi)
    p_bits = jnp.where(top_p < 1, p_bits, 0)
    return jax.lax.bitcast_convert_type(jnp.maximum(p_bits, k_bits), jnp.float32)


def _filter_threshold(probs: jax.Array, a: SamplingArrays) -> jax.Array:
    """Per-row probability threshold implementing top-k then top-p (keep p >= threshold)."""
    R, V = probs.shape
    C = min(V, CANDIDATES)    # V < CANDIDATES: k > C never happens (k >= V is off)
    cand, _ = jax.lax.top_k(probs, C)                               # [R, C], descending
    k = jnp.where(a.top_k >= V, 0, a.top_k)
    k_thr = jnp.where(k > 0, jnp.take_along_axis(cand, jnp.clip(k - 1, 0, C - 1)[:, None], 1)[:, 0],
                      0.0)
    in_k = cand >= k_thr[:, None]
    total = jnp.where(k > 0, jnp.sum(jnp.where(in_k, cand, 0.0), -1), jnp.sum(probs, -1))
    csum = _cumsum(jnp.where(in_k, cand, 0.0))
    target = a.top_p * total
    reached = csum >= target[:, None]
    n = jnp.argmax(reached, axis=-1)                                # first index reaching top_p
    p_thr = jnp.where(a.top_p < 1, jnp.take_along_axis(cand, n[:, None], 1)[:, 0], 0.0)
    need_exact = (k > C) | ((a.top_p < 1) & ~reached[:, -1])
    fast = jnp.maximum(k_thr, p_thr)

    def exact(_):
        return jnp.where(need_exact, _exact_top_p_threshold(probs, k, k_thr, a.top_p), fast)
    return jax.lax.cond(jnp.any(need_exact), exact, lambda _: fast, None)


def _cumsum(x: jax.Array) -> jax.Array:
    """Inclusive cumsum over the last (short) axis as a matmul with a triangular mask: XLA:CPU
    compiles it ~3x faster than jnp.cumsum. Not guaranteed monotone under rounding; callers never
    rely on that (they also require a positive weight)."""
    n = x.shape[-1]
    tri = (jnp.arange(n)[:, None] <= jnp.arange(n)[None, :]).astype(x.dtype)
    return jnp.dot(x, tri, precision=jax.lax.Precision.HIGHEST)


def _uniforms(key: jax.Array, n: int) -> jax.Array:
    """f32[R, n] uniforms strictly inside (0, 1) from each row's key: a hash of (key, index).
    The largest hash, (2**24 - 1) + 0.5, rounds to 2**24 in f32: u would be 1.0 and its Gumbel
    noise +inf (once in 2**24 draws), hence the cap at the largest f32 below 1."""
    idx = jnp.arange(n, dtype=jnp.uint32)[None, :] * jnp.uint32(0x9E3779B9)
    h = _mix32(idx ^ key[:, None])
    u = ((h >> 8).astype(jnp.float32) + 0.5) * jnp.float32(1.0 / (1 << 24))
    return jnp.minimum(u, jnp.float32(1.0 - 2.0 ** -24))


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, -1) of a [R, V] array (the first index of the row's max) as int32, from
    vectorised max reductions: each chunk's max, the first chunk that holds the row's max, then
    the first index of it there. NaN rows aside, the same index as jnp.argmax."""
    R, V = x.shape
    c = _ARGMAX_CHUNK
    if V < 4 * c:
        return jnp.argmax(x, -1).astype(jnp.int32)
    n = -(-V // c)
    chunks = jnp.pad(x, ((0, 0), (0, n * c - V)), constant_values=-jnp.inf).reshape(R, n, c)
    chunk_max = jnp.max(chunks, -1)
    row_max = jnp.max(chunk_max, -1, keepdims=True)
    first = jnp.argmax(chunk_max == row_max, -1)
    inner = jnp.take_along_axis(chunks, first[:, None, None], 1)[:, 0]
    return (first * c + jnp.argmax(inner == row_max, -1)).astype(jnp.int32)


def _gumbel_argmax(weights: jax.Array, key: jax.Array) -> jax.Array:
    """argmax(log w + Gumbel noise) per row: index i with probability w[i] / sum(w). A zero
    weight scores -inf whatever its noise (noise added first could make it NaN, which argmax
    takes)."""
    g = -jnp.log(-jnp.log(_uniforms(key, weights.shape[-1])))
    return jnp.argmax(jnp.where(weights > 0, jnp.log(weights) + g, -jnp.inf), -1)


def _sample_weights(weights: jax.Array, key: jax.Array) -> jax.Array:
    """Index i of each row with probability weights[i] / sum(weights), in two levels: a block of
    _BLOCK tokens by its total weight, then a token of that block, each a Gumbel-max draw (the
    max of a block's noisy log-weights is its log-total plus Gumbel noise, so the two levels are
    exact). Gumbel-max, unlike an inverse CDF, changes its pick only when two noisy scores are
    within rounding of each other: logits that differ in the last bits (another bucket, batch or
    prefix-cache state) give the same seeded token, where a CDF over a 49k-token tail would
    move its boundaries past the uniform. Noise for 2 x 256 draws per row, not the vocab."""
    R, V = weights.shape
    nb = -(-V // _BLOCK)
    w = jnp.pad(weights, ((0, 0), (0, nb * _BLOCK - V))).reshape(R, nb, _BLOCK)
    b = _gumbel_argmax(jnp.sum(w, -1), key)
    inner = jnp.take_along_axis(w, b[:, None, None], 1)[:, 0]      # [R, BLOCK]
    i = _gumbel_argmax(inner, _mix32(key ^ jnp.uint32(0x5BD1E995)))
    return (b * _BLOCK + i).astype(jnp.int32)


def _mix32(x: jax.Array) -> jax.Array:
    """lowbias32 integer finalizer (full avalanche on uint32)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _row_keys(a: SamplingArrays) -> jax.Array:
    """One u32 key per row from (seed, step) alone: a counter-based hash. Threefry gives the
    same guarantee but costs ~0.9 s of XLA:CPU compile per bucket against ~0.1 s for this."""
    x = _mix32(a.step.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + jnp.uint32(0x85EBCA6B))
    x = _mix32(x ^ a.seed[:, 1])
    return _mix32(x ^ a.seed[:, 0])


def _sample_rows(logits: jax.Array, a: SamplingArrays) -> jax.Array:
    greedy_ids = argmax(logits)
    temp = jnp.where(a.temperature > 0, a.temperature, 1.0)
    probs = jax.nn.softmax(logits / temp[:, None], axis=-1)
    needs_filter = jnp.any((a.top_k > 0) | (a.top_p < 1))
    thr = jax.lax.cond(needs_filter, _filter_threshold,
                       lambda p, _: jnp.zeros(p.shape[:1], p.dtype), probs, a)
    thr = jnp.maximum(thr, a.min_p * jnp.max(probs, -1))
    weights = jnp.where(probs >= thr[:, None], probs, 0.0)
    sampled = _sample_weights(weights, _row_keys(a))
    # The guarantee, whatever the parameters do to the probabilities (NaN from an overflowing
    # temperature, a filter that keeps nothing): a token of zero weight is never returned. A
    # masked token has probability exactly 0, so it is never sampled; the fallback is the argmax
    # of the masked logits.
    kept = jnp.take_along_axis(weights, sampled[:, None], 1)[:, 0] > 0
    return jnp.where((a.temperature > 0) & kept, sampled, greedy_ids)


def _top(logprobs: jax.Array, k: int):
    if k == 0:
        R = logprobs.shape[0]
        return jnp.zeros((R, 0), jnp.int32), jnp.zeros((R, 0), jnp.float32)
    vals, ids = jax.lax.top_k(logprobs, k)
    return ids.astype(jnp.int32), vals


def sample_logits(logits: jax.Array, a: SamplingArrays, num_top_logprobs: int) -> SampleOutput:
    """Token ids (and, for slots that ask, logprobs) from the logits f32[S, V] of S slots."""
    logits = process_logits(logits, a)
    all_greedy = jnp.all(a.temperature == 0)
    token_ids = jax.lax.cond(all_greedy, lambda l, _: argmax(l),
                             _sample_rows, logits, a)
    # ~70% of a greedy 32-row sampling step on the CPU (tools/bench_step.py): only when asked
    chosen, top_ids, top_lp = jax.lax.cond(
        jnp.any(a.logprobs), lambda l, t: token_logprobs(l, t, num_top_logprobs),
        lambda l, t: no_logprobs(l.shape[0], num_top_logprobs), logits, token_ids)
    return SampleOutput(token_ids, chosen, top_ids, top_lp)




def no_logprobs(n: int, num_top_logprobs: int):
    """Zeros in the shape of `token_logprobs`' result, for steps that skip it."""
    return (jnp.zeros(n, jnp.float32), jnp.zeros((n, num_top_logprobs), jnp.int32),
            jnp.zeros((n, num_top_logprobs), jnp.float32))


def token_logprobs(logits_all: jax.Array, token_ids: jax.Array, num_top_logprobs: int):
    """Logprob of each given token (logits_all[t] predicts token_ids[t]) and the top-k: prompt
    logprobs, and the sampled tokens' logprobs."""
    logits_all = logits_all.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits_all, axis=-1)
    chosen = jnp.take_along_axis(logits_all, token_ids[:, None].astype(jnp.int32), 1)[:, 0] - lse
    top_ids, top_lp = _top(logits_all, num_top_logprobs)
    return chosen, top_ids, top_lp - lse[:, None]
