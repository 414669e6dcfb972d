"""Compare maxjax with its peers on one machine, in one run, on the same model and workload:

  * maxjax:       `maxjax serve --max-batch-size 32` once per weight encoding (--encodings:
                  `auto`, serve's default (int8 for a quantized GGUF), and float32 by default;
                  q4_1 etc. on request: the GGUF's own 4-bit blocks), measured by
                  `maxjax benchmark`;
  * llama-server: native llama.cpp with parallel slots (`-np` = the highest concurrency,
                  continuous batching), what a llama.cpp user runs; same benchmark. Built by
                  tools/build_llama_server.sh from the llama.cpp source in the PyPI sdist of
                  llama-cpp-python (-march=native: AMX where the CPU has it), found at --llama-server
                  (default $LLAMA_SERVER, else /work/cache/llama-server/bin/llama-server);
  * transformers: no server: an offline `generate` loop over static batches of 1/8/32 prompts
                  on the same GGUF (dequantized to f32 by transformers), greedy, exactly
                  --output-len new tokens; TTFT is a separate one-token `generate` of the batch.

Default workload: the embedded SmolLM2-135M GGUF, 128-token prompts (the same text for every
peer, cut to exactly 128 tokens by the model's tokenizer, distinct per request so no prefix
cache helps), 128 output tokens with ignore_eos / min_tokens, concurrency 1, 8, 32.

Writes OUT_DIR/results.md (markdown table for BENCHMARKS.md), results.json, plot.png (with
matplotlib), prompts.jsonl and one log per server; prints the table. A peer that is missing (no
llama-server binary, no torch) is skipped with a note.

    .venv/bin/python tools/compare_peers.py [--peers maxjax,llama-server,transformers]
        [--encodings auto,float32] [--concurrency 1,8,32] [--input-len 128] [--output-len 128]
        [--out-dir bench_results]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

PEERS = ("maxjax", "llama-server", "transformers")
DEFAULT_LLAMA_SERVER = "/work/cache/llama-server/bin/llama-server"
LLAMA_CPP_PYTHON = "0.3.36"     # tools/build_llama_server.sh's default


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="maxjax vs llama-server vs transformers: one "
                                 "machine, one model, one workload.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--peers", default=",".join(PEERS), help="Comma-separated subset of "
                    f"{', '.join(PEERS)} (default: all)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, help="Requests per level (default: the "
                    "benchmark's, 4 x concurrency, at least 8)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="CPU threads for llama-server and torch (default: all, like XLA)")
    ap.add_argument("--max-batch-size", type=int, default=32, help="maxjax serve's")
    ap.add_argument("--maxjax-args", default="", help="Extra `maxjax serve` flags, one string")
    ap.add_argument("--encodings", default="auto,float32", help="maxjax runs, one per "
                    "--quantization-encoding (auto: serve's default)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA_SERVER),
                    help="The llama-server binary (tools/build_llama_server.sh builds it)")
    ap.add_argument("--startup-timeout", type=float, default=1200,
                    help="Seconds to wait for a server to answer /v1/models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="bench_results")
    args = ap.parse_args(argv)
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [p for p in args.peers if p not in PEERS]
    if bad:
        ap.error(f"--peers: unknown {bad}; choose from {', '.join(PEERS)}")
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.encodings = [e.strip() for e in args.encodings.split(",") if e.strip()]
    if any(c < 1 for c in args.levels) or args.input_len < 1 or args.output_len < 1:
        ap.error("concurrency levels, --input-len and --output-len must be positive")
    return args


# -- the shared workload ---------------------------------------------------------------------------

def load_tokenizer(gguf: str):
    from transformers import AutoTokenizer
    directory, name = os.path.split(os.path.abspath(gguf))
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def make_prompts(tokenizer, n: int, input_len: int, seed: int) -> list[str]:
    """n distinct texts of exactly input_len tokens (without special tokens)."""
    from maxjax.bench.client import WORDS
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        words = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        ids = tokenizer.encode(words, add_special_tokens=False)[:input_len]
        text = tokenizer.decode(ids)
        # A cut can re-merge differently; such a prompt is dropped, not approximated.
        if len(tokenizer.encode(text, add_special_tokens=False)) == input_len:
            prompts.append(text)
    return prompts


def total_requests(levels: list[int], num_prompts: int | None) -> int:
    """Warm-up rounds plus measured requests over all levels (each peer gets the same ones)."""
    return sum(c + (num_prompts or max(8, 4 * c)) for c in levels)


# -- servers ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_command(peer: str, gguf: str, port: int, args) -> list[str]:
    """`peer`: "maxjax (ENCODING)" or "llama-server"."""
    if peer.startswith("maxjax"):
        encoding = peer[len("maxjax ("):-1]
        flags = [] if encoding == "auto" else ["--quantization-encoding", encoding]
        return [sys.executable, "-m", "maxjax.cli", "serve", "--model-path", gguf,
                "--host", "127.0.0.1", "--port", str(port),
                "--max-batch-size", str(args.max_batch_size), *flags, *args.maxjax_args.split()]
    slots = max(args.levels)
    # a context of (prompt + output + margin) per slot; --no-repack as in DESIGN.md's recipe
    ctx = slots * (args.input_len + args.output_len + 64)
    return [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(ctx), "-t", str(args.threads), "-tb", str(args.threads),
            "--no-repack", "--no-webui"]


def bench_server(peer: str, gguf: str, dataset: str, args) -> dict:
    """Start the peer's server, run `maxjax benchmark` against it, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", peer).strip("-")
    log_path = os.path.join(args.out_dir, f"{slug}.log")
    result_path = os.path.join(args.out_dir, f"{slug}.json")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_command(peer, gguf, port, args), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t0 = time.perf_counter()
            wait_ready(url, proc, args.startup_timeout, log_path)
            startup = time.perf_counter() - t0
            print(f"[{peer}] ready in {startup:.1f} s at {url}", file=sys.stderr)
            cmd = [sys.executable, "-m", "maxjax.cli", "benchmark", "--base-url", url,
                   "--dataset", dataset, "--output-len", str(args.output_len),
                   "--concurrency", ",".join(map(str, args.levels)), "--warmup",
                   "--label", peer, "--result-json", result_path]
            if args.num_prompts:
                cmd += ["--num-prompts", str(args.num_prompts)]
            rc = subprocess.call(cmd)
        finally:
            stop(proc)
    if rc not in (0, 1) or not os.path.exists(result_path):
        raise RuntimeError(f"maxjax benchmark exited with {rc}")
    with open(result_path) as f:
        result = json.load(f)
    result["startup_s"] = startup
    return result


# -- transformers, offline -------------------------------------------------------------------------

def bench_transformers(gguf: str, tokenizer, prompts: list[str], args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from maxjax.bench.report import distribution
    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    directory, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    out_len = args.output_len

    def generate(batch: list[str], new_tokens: int) -> float:
        enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        seconds = time.perf_counter() - t0
        assert out.shape[1] - enc["input_ids"].shape[1] == new_tokens
        return seconds

    levels, next_prompt = [], 0
    for b in args.levels:
        batch = [prompts[(next_prompt + i) % len(prompts)] for i in range(b)]
        next_prompt += b
        generate(batch, 2)                                  # warm-up
        ttft = generate(batch, 1)
        seconds = generate(batch, out_len)
        print(f"[transformers] batch {b}: {b * out_len / seconds:.1f} output tok/s",
              file=sys.stderr)
        tpot = (seconds - ttft) / (out_len - 1) if out_len > 1 else None
        levels.append({
            "concurrency": b, "num_requests": b, "completed": b, "errors": 0, "error_samples": [],
            "duration_s": seconds, "input_tokens": b * args.input_len,
            "output_tokens": b * out_len, "usage_reported": True, "short_outputs": 0,
            "requests_per_s": b / seconds, "output_tok_per_s": b * out_len / seconds,
            "total_tok_per_s": b * (args.input_len + out_len) / seconds,
            "ttft_ms": distribution([ttft]), "tpot_ms": distribution([tpot] if tpot else []),
            "itl_ms": distribution([]), "e2e_ms": distribution([seconds]),
        })
    return {"label": "transformers", "offline": True, "levels": levels}


# -- report ----------------------------------------------------------------------------------------

def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_report(results: dict, notes: list[str], gguf: str, args) -> str:
    from maxjax.bench import report as bench_report
    series = {peer: r["levels"] for peer, r in results.items()}
    table = bench_report.markdown_table(*bench_report.compact_rows(series))
    versions = ", ".join(f"{p} {_version(p)}" for p in ("maxjax", "jax", "transformers",
                                                          "torch"))
    versions += f", llama-server from the llama-cpp-python {LLAMA_CPP_PYTHON} sdist"
    lines = [
        f"## maxjax vs peers ({datetime.date.today().isoformat()})", "",
        f"- Machine: {_cpu_name()}, {os.cpu_count()} CPUs; {args.threads} threads for "
        f"llama-server and torch; load average at the start {os.getloadavg()[0]:.1f}.",
        f"- Model: `{os.path.basename(gguf)}`. Workload: {args.input_len}-token prompts (same "
        f"text for every peer), {args.output_len} output tokens (ignore_eos / min_tokens), "
        f"greedy, concurrency {', '.join(map(str, args.levels))}; one unmeasured warm-up round "
        "per level.",
        f"- Versions: {versions}.", "",
        table, "",
        "- maxjax and llama-server: streaming HTTP through `maxjax benchmark` (TTFT/TPOT per "
        f"request); llama-server with {max(args.levels)} parallel slots (`-np`), continuous "
        "batching. maxjax (ENCODING): `--quantization-encoding`, auto = serve's default.",
        "- transformers: offline static batches (no server, no HTTP); \"load\" is the batch "
        "size, TTFT the batch's prefill + first token.",
    ]
    lines += [f"- {n}" for n in notes]
    if importlib.util.find_spec("matplotlib") and series:
        path = os.path.join(args.out_dir, "plot.png")
        bench_report.plot(series, path, title=f"{os.path.basename(gguf)}: {args.input_len} in, "
                                              f"{args.output_len} out")
        lines += ["", f"![throughput and TTFT]({os.path.basename(path)})"]
    else:
        lines += ["- No plot: `pip install matplotlib`."]
    report = "\n".join(lines) + "\n"
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"model": gguf, "results": results, "notes": notes}, f, indent=2)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.makedirs(args.out_dir, exist_ok=True)
    from maxjax.models.loader import embedded_model_path
    gguf = args.model or embedded_model_path()
    tokenizer = load_tokenizer(gguf)
    prompts = make_prompts(tokenizer, total_requests(args.levels, args.num_prompts),
                           args.input_len, args.seed)
    dataset = os.path.join(args.out_dir, "prompts.jsonl")
    with open(dataset, "w") as f:
        # prompt_tokens: what the benchmark counts for a server that reports no usage.
        f.writelines(json.dumps({"prompt": p, "prompt_tokens": args.input_len}) + "\n"
                     for p in prompts)

    results, notes, failed = {}, [], []
    runs = [f"maxjax ({e})" if p == "maxjax" else p for p in args.peers
            for e in (args.encodings if p == "maxjax" else [None])]
    for peer in runs:
        if peer == "llama-server" and not os.access(args.llama_server, os.X_OK):
            notes.append(f"llama-server skipped: no binary at {args.llama_server} (build it with "
                         "tools/build_llama_server.sh)")
            continue
        if peer == "transformers" and importlib.util.find_spec("torch") is None:
            notes.append("transformers skipped: torch is not installed")
            continue
        print(f"[{peer}] running", file=sys.stderr)
        try:
            if peer == "transformers":
                results[peer] = bench_transformers(gguf, tokenizer, prompts, args)
            else:
                results[peer] = bench_server(peer, gguf, dataset, args)
        except (RuntimeError, OSError, ImportError) as e:
            notes.append(f"{peer} failed: {e}")
            failed.append(peer)
            print(f"[{peer}] failed: {e}", file=sys.stderr)
    print(write_report(results, notes, gguf, args))
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
