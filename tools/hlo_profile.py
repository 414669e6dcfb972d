"""Where a compiled step spends its time: a `jax.profiler` trace of some calls, each HLO op's time
attributed to the graph function that emitted it (the innermost frame under graphs/ in the op's
stack-frame metadata, e.g. `quant.py:linear`, `attention.py:paged_attention`), summed per call.

    from hlo_profile import profile_phases      # with tools/ on sys.path
    phases = profile_phases(compiled, run, iters=5)   # {"quant.py:linear": ms per call, ...}

`run()` makes one call of `compiled` and waits for it. Used by tools/bench_quant.py --profile.
"""
from __future__ import annotations

import glob
import os
import re
import tempfile
from collections import defaultdict

import jax

_CONTAINERS = {"while", "conditional", "call"}
_TABLE = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)$")


def _tables(text: str) -> dict[str, dict[int, str]]:
    tables: dict[str, dict[int, str]] = defaultdict(dict)
    current = None
    for line in text.splitlines():
        if _TABLE.match(line):
            current = line
        elif not line.strip():
            current = None
        elif current and (m := re.match(r"^(\d+) (.*)$", line)):
            tables[current][int(m.group(1))] = m.group(2)
    return tables


def frame_labels(text: str) -> dict[int, str]:
    """stack_frame_id -> "file.py:function" of its innermost frame in a graphs/ file (else the
    innermost frame's)."""
    t = _tables(text)
    files = {k: v.strip('"') for k, v in t["FileNames"].items()}
    funcs = {k: v.strip('"') for k, v in t["FunctionNames"].items()}
    locs = {}
    for k, v in t["FileLocations"].items():
        f = re.search(r"file_name_id=(\d+) function_name_id=(\d+)", v)
        locs[k] = (files.get(int(f.group(1)), "?"), funcs.get(int(f.group(2)), "?"))
    frames = {}
    for k, v in t["StackFrames"].items():
        f = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", v)
        frames[k] = (int(f.group(1)), int(f.group(2)))
    labels = {}
    for fid in frames:
        chain, seen, cur = [], set(), fid
        while cur in frames and cur not in seen:
            seen.add(cur)
            chain.append(locs.get(frames[cur][0], ("?", "?")))
            cur = frames[cur][1]
        ours = [c for c in chain if "/graphs/" in c[0]]
        file, func = (ours or chain or [("?", "?")])[0]
        labels[fid] = f"{os.path.basename(file)}:{func}"
    return labels


def op_labels(text: str) -> dict[str, str]:
    """HLO instruction name -> its label: frame_labels' for an instruction with a stack frame,
    else its jax op name ("op:dot_general"), else its HLO opcode ("hlo:copy")."""
    labels = frame_labels(text)
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = .*? ([a-z][\w\-]*)\((.*)$", text, re.M):
        name, opcode, rest = m.groups()
        if opcode in _CONTAINERS:
            continue            # their events span their bodies' ops, which count themselves
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        op = re.search(r'op_name="([^"]*)"', rest)
        out[name] = (labels.get(int(frame.group(1)), "?") if frame else
                     f"op:{op.group(1).rsplit('/', 1)[-1]}" if op else f"hlo:{opcode}")
    return out


def profile_phases(compiled, run, iters: int = 5) -> dict[str, float]:
    """{label: ms per call} over `iters` traced calls of `run` (which calls `compiled`)."""
    names = op_labels(compiled.as_text())
    totals: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(iters):
                run()
        path = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0]
        data = jax.profiler.ProfileData.from_file(path)
        for plane in data.planes:
            for line in plane.lines:
                for ev in line.events:
                    label = names.get(ev.name)
                    if label is not None:
                        totals[label] += ev.duration_ns / 1e6 / iters
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
