"""Prompt-lookup (n-gram) proposals for speculative decoding, on the host.

The last n tokens of a request (prompt + output) are looked up earlier in the same sequence, from
the longest n down to the shortest; the k tokens that followed the most recent earlier match are
the proposal. Copy-heavy requests (repeat, edit or quote a given text or code) accept most of
them; elsewhere a lookup usually finds nothing and the row decodes as usual.
"""
from __future__ import annotations

import numpy as np


def propose(tokens, k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens to draft after `tokens`; [] when no suffix of min_n..max_n tokens recurs."""
    seq = np.asarray(tokens, np.int64)
    L = len(seq)
    if k < 1:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows[i] = seq[i:i + n] for every start i whose n-gram ends before the suffix does
        windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)
        hits = np.flatnonzero((windows == seq[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start:start + k].tolist()
    return []
