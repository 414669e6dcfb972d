"""A stand-in for ModelRunner + graph in scheduler and engine tests: compiles nothing, and its outputs
can be worked out by hand (`reference_generate`).

It keeps a fake KV cache, one integer per slot (page * page_size + offset), and uses it the way a
real model does: each token's "K/V" is a hash of the previous position's value (read back through the
page table), its token and its position, so a slot's value stands for the whole prefix; the next token
"attends" over every slot of the sequence. A page handed to the wrong request, a stale or wrongly
reused prefix page, a wrong slot or position all change the outputs, or raise on an unwritten slot.
"""
from __future__ import annotations

_MASK = (1 << 64) - 1


def _mix(h: int, x: int) -> int:
    h = ((h ^ (x & _MASK)) * 0x9E3779B97F4A7C15) & _MASK
    return h ^ (h >> 29)


def kv_value(prev: int, token: int, pos: int) -> int:
    return _mix(_mix(prev, token), pos)


def next_token(values, vocab_size: int) -> int:
    acc = 0x5EED
    for v in values:
        acc = _mix(acc, v)
    return acc % vocab_size


def reference_generate(prompt, num_tokens: int, vocab_size: int) -> list[int]:
    """What the mock generates for `prompt` alone, with no paging, no stop checks."""
    values, prev, out = [], 0, []
    seq = list(prompt)
    pos = 0
    while len(out) < num_tokens:
        while pos < len(seq):
            prev = kv_value(prev, seq[pos], pos)
            values.append(prev)
            pos += 1
        out.append(next_token(values, vocab_size))
        seq.append(out[-1])
    return out


class MockModel:
    def __init__(self, page_size: int, vocab_size: int = 1000):
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.kv: dict[int, int] = {}
        self.num_steps = 0

    def _slot(self, pages, pos: int) -> int:
        page = pages[pos // self.page_size]
        if page == 0:
            raise AssertionError(f"position {pos} maps to the scratch page")
        return page * self.page_size + pos % self.page_size

    def _read(self, pages, pos: int) -> int:
        slot = self._slot(pages, pos)
        if slot not in self.kv:
            raise AssertionError(f"read of unwritten slot {slot} (position {pos})")
        return self.kv[slot]

    def run(self, rows) -> list[int]:
        """One step: a StepPlan, or rows carrying token_ids, start_pos, pages (RowSlices).
        Returns one token per row (meaningless for rows whose last token samples nothing), or,
        for a row with several sample slots (draft tokens), the list of its slots' tokens."""
        rows = getattr(rows, "rows", rows)
        self.num_steps += 1
        out = []
        for row in rows:
            pages, start = row.pages, row.start_pos
            for k, tok in enumerate(row.token_ids):
                pos = start + k
                prev = self._read(pages, pos - 1) if pos else 0
                self.kv[self._slot(pages, pos)] = kv_value(prev, tok, pos)
            last = start + len(row.token_ids)
            k = getattr(row, "num_samples", 1)
            toks = [next_token((self._read(pages, p) for p in range(end)), self.vocab_size)
                    for end in range(last - max(k, 1) + 1, last + 1)]
            out.append(toks[0] if k <= 1 else toks)
        return out


def drive(scheduler, model: MockModel, max_steps: int = 100_000, on_step=None) -> int:
    """Run the schedule/run/update loop until every request finished. on_step(plan) is called
    before each model run. Returns the number of steps."""
    steps = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        if plan is None:
            raise AssertionError("scheduler idle with unfinished requests (deadlock)")
        if on_step is not None:
            on_step(plan)
        scheduler.update(plan, model.run(plan.rows))
        steps += 1
        if steps > max_steps:
            raise AssertionError(f"not done after {max_steps} steps (livelock?)")
    return steps
