"""Pins: the values a start must run with that the user's flags do not choose (what artifacts were
built with, the plan of a group's process 0 or of the first data-parallel replica), and the one
place they meet the flags (`adopt_pins`). Called by the planner (maxjax/engine/plan.py `prepare`,
`Prepared.adopt`) and the artifacts' loader (maxjax/aot/load.py), which reads what they pin.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from maxjax.engine.config import EngineConfig
from maxjax.errors import UserError

# What artifacts (or a group's process 0) pin: the layout values a run adopts.
PINNED_FIELDS = ("max_length", "num_kv_pages")


@dataclass(frozen=True)
class Pins:
    """Values a start must run with that the user's flags do not choose: what artifacts were
    built with (maxjax/aot/load.py), or the plan of a group's process 0 or of the first
    data-parallel replica (`EnginePlan.pins`). The planner adopts them (`adopt_pins`), the one
    place pins meet flags. `refuse(field, have, want)`: the UserError's text for a flag the user
    chose with another value (None: the pins are another plan of the same flags, adopted)."""
    values: dict = field(default_factory=dict)
    refuse: Any = None


def user_chose(flags: EngineConfig, name: str) -> bool:
    """Whether the user's `flags` hold a value of their own for `name`: set, and neither the
    field's default nor (a ResolvedConfig's) a platform default filled in."""
    value = getattr(flags, name)
    return not (value is None or flags.is_default(name) or value == _FIELD_DEFAULTS[name])


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def adopt_pins(flags: EngineConfig, pins: Pins | dict | None,
               chosen: EngineConfig | None = None) -> EngineConfig:
    """`flags` with `pins` adopted: a value the user did not choose (in `chosen`, the user's
    flags; None: `flags` are) takes the pinned one, a chosen other value is refused (a
    UserError naming the flag)."""
    if not isinstance(pins, Pins):
        pins = Pins(dict(pins or {}))
    adopted = {}
    for k, want in pins.values.items():
        have = getattr(flags, k)
        if have == want:
            continue
        if pins.refuse is not None and user_chose(flags if chosen is None else chosen, k):
            raise UserError(pins.refuse(k, have, want))
        adopted[k] = want
    return flags.replace(**adopted) if adopted else flags
