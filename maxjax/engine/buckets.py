"""The set of compiled step shapes: a pure function of the engine config, known before start-up.

Token buckets T are powers of two up to the step's token budget. Rows R follow T (R = min(T,
max_batch_size)): decode-only steps have T == R, and for bigger T padding R costs only R
logit rows, which is small next to T tokens through every layer. One graph per T keeps the
bucket count (and start-up compile time) at log2(budget) + 1.

Speculative decoding adds, for each T > R, a verification bucket with S = min(T, R * (k + 1))
sample slots (S == R would add nothing for T <= R): a step without drafts keeps the one-slot-per-
row graph (the extra slots cost LM-head rows and sampling), a step with drafts takes the other.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int      # T
    num_rows: int        # R
    num_samples: int = 0   # S sample slots (0: one per row, S = R)

    def __post_init__(self):
        if not self.num_samples:
            object.__setattr__(self, "num_samples", self.num_rows)

    @property
    def name(self) -> str:
        extra = f"_s{self.num_samples}" if self.num_samples != self.num_rows else ""
        return f"step_t{self.num_tokens}_r{self.num_rows}{extra}"


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket_set(max_batch_input_tokens: int, max_batch_size: int,
               samples_per_row: int = 1) -> list[Bucket]:
    """`samples_per_row` > 1 (draft tokens + 1) adds the verification buckets."""
    top = _pow2_at_least(max(max_batch_input_tokens, max_batch_size))
    out, t = [], 1
    while t <= top:
        rows = min(t, _pow2_at_least(max_batch_size))
        out.append(Bucket(t, rows))
        if min(t, rows * samples_per_row) > rows:
            out.append(Bucket(t, rows, min(t, rows * samples_per_row)))
        t *= 2
    return out


def pick_bucket(buckets: list[Bucket], num_tokens: int, num_rows: int,
                num_samples: int = 0) -> Bucket:
    for b in buckets:
        if b.num_tokens >= num_tokens and b.num_rows >= num_rows and b.num_samples >= num_samples:
            return b
    raise ValueError(f"no bucket holds {num_tokens} tokens in {num_rows} rows "
                     f"with {num_samples} sample slots")
