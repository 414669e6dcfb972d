"""Fault injection for the reliability tests (tests/test_faults.py) and `tools/soak.py
--faults`: the environment variable MAXJAX_FAULTS holds comma-separated faults, installed by
AsyncEngine.start. Unset (always, in production), nothing is wrapped and nothing costs.

  device_step:SEED   the model step raises on any step holding a row sampled with seed SEED
                     (before it reaches the KV pool, as a failed launch or a NaN check would)
  engine_thread:N    the engine loop thread dies at its N-th step (an exception no step guard
                     catches, as a bug in the loop itself would)
"""
from __future__ import annotations

import os

ENV = "MAXJAX_FAULTS"


class InjectedFault(RuntimeError):
    pass


class EngineThreadDeath(BaseException):
    """Escapes every `except Exception`: the loop thread dies as it would on a bug."""


def parse(spec: str) -> dict[str, int]:
    faults = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, arg = item.partition(":")
        if kind not in ("device_step", "engine_thread") or not arg.lstrip("-").isdigit():
            raise ValueError(f"{ENV}: {item!r} is not device_step:SEED or engine_thread:N")
        faults[kind] = int(arg)
    return faults


def install(core, spec: str | None = None) -> dict[str, int]:
    """Wrap `core`'s runner and step for the faults in `spec` (default: $MAXJAX_FAULTS)."""
    faults = parse(os.environ.get(ENV, "") if spec is None else spec)
    if "device_step" in faults:
        seed, run = faults["device_step"], core.runner.run

        def faulty_run(rows):
            if any(r.params.seed == seed for r in rows):
                raise InjectedFault(f"injected device step fault (seed {seed})")
            return run(rows)
        core.runner.run = faulty_run
    if "engine_thread" in faults:
        at, step, count = faults["engine_thread"], core.step, [0]

        def dying_step():
            count[0] += 1
            if count[0] >= at:
                raise EngineThreadDeath(f"injected engine thread death at step {count[0]}")
            return step()
        core.step = dying_step
    return faults
