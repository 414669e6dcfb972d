"""Time loading the embedded SmolLM2 GGUF: maxjax's `load_model(None)` (header parse, tokenizer,
dequantization, device placement) against transformers' own GGUF loader (AutoTokenizer +
AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)). Best of N, imports excluded (both
libraries are imported once before timing).

    .venv/bin/python tools/bench_load.py [--repeats 3] [--model PATH.gguf]
"""
from __future__ import annotations

import argparse
import os
import time
import warnings


def best_of(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")

    t0 = time.perf_counter()
    from maxjax.models.loader import embedded_model_path, load_model
    import jax
    import transformers  # noqa: F401  (our tokenizer comes from it: import it outside the timing)
    jax.numpy.zeros(1).block_until_ready()
    import_ours = time.perf_counter() - t0
    path = args.model or embedded_model_path()

    def ours():
        m = load_model(args.model, "float32", progress=False)
        jax.block_until_ready(m.params)

    rows = [("maxjax load_model (GGUF)", import_ours, *best_of(ours, args.repeats))]

    if not args.skip_transformers:
        t0 = time.perf_counter()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        AutoModelForCausalLM, AutoTokenizer  # resolve transformers' lazy imports before timing
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        import_hf = time.perf_counter() - t0
        directory, name = os.path.split(os.path.abspath(path))

        def theirs():
            AutoTokenizer.from_pretrained(directory, gguf_file=name)
            AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)

        rows.append(("transformers GGUF (tokenizer+model)", import_hf, *best_of(theirs, args.repeats)))

    print(f"model: {path} ({os.path.getsize(path) / 2**20:.0f} MiB), best of {args.repeats}")
    print(f"{'loader':38s} {'import s':>9s} {'best s':>8s}  all runs")
    for label, imp, best, times in rows:
        print(f"{label:38s} {imp:9.2f} {best:8.2f}  {', '.join(f'{t:.2f}' for t in times)}")
    if len(rows) == 2:
        print(f"speedup: {rows[1][2] / rows[0][2]:.1f}x")


if __name__ == "__main__":
    main()
