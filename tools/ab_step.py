"""Interleaved A/B of tools/bench_step.py between this tree and another git revision.

Each round runs the revision's own bench_step.py and then this tree's, so both see the same drift
of this machine; the table gives each case's median over rounds and the ratio. The revision is
installed from a worktree into a venv of its own that reads this venv's other packages through a
.pth line (whose directory's own .pth files, this tree's editable install among them, are not run).

    .venv/bin/python tools/ab_step.py --against REV [--rounds 3] [-- bench_step args]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\| (.+?) \| (\d+) \| [\d.]+ \| ([\d.]+) \|")
SAMPLING = re.compile(r"greedy sampling of (\d+) rows: ([\d.]+) ms; with logprobs \+ top 20: ([\d.]+) ms")


def install(rev: str) -> tuple[str, str]:
    """(worktree, python) for `rev`."""
    base = tempfile.mkdtemp(prefix="maxjax-ab-")
    tree, venv = os.path.join(base, "tree"), os.path.join(base, "venv")
    subprocess.run(["git", "worktree", "add", "--detach", tree, rev], cwd=ROOT, check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site = sysconfig.get_path("purelib", vars={"base": venv})
    with open(os.path.join(site, "maxjax-ab-deps.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", site, tree], check=True)
    return tree, os.path.join(venv, "bin", "python")


def run(tree: str, python: str, args: list[str]) -> dict[str, float]:
    out = subprocess.run([python, os.path.join(tree, "tools", "bench_step.py"), *args],
                         cwd=tree, capture_output=True, text=True, check=True).stdout
    got = {m.group(1): float(m.group(3)) for m in map(ROW.match, out.splitlines()) if m}
    m = SAMPLING.search(out)
    if m:
        got[f"sampling {m.group(1)} rows, greedy"] = float(m.group(2))
        got[f"sampling {m.group(1)} rows, logprobs"] = float(m.group(3))
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("bench_args", nargs="*")
    args = ap.parse_args()
    tree, python = install(args.against)
    try:
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for name, t, py in ((args.against, tree, python), ("this tree", ROOT, sys.executable)):
                for case, ms in run(t, py, args.bench_args).items():
                    times.setdefault((name, case), []).append(ms)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        cases = list(dict.fromkeys(c for _, c in times))
        print(f"| case | {args.against} ms | this tree ms | ratio (this / {args.against}) |")
        print("|---|---|---|---|")
        for c in cases:
            a = statistics.median(times.get((args.against, c), [float("nan")]))
            b = statistics.median(times.get(("this tree", c), [float("nan")]))
            print(f"| {c} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
