"""`maxjax benchmark`'s flags, apart from maxjax/bench/command.py so that building the CLI's
parser imports no HTTP client (every `maxjax serve` builds it)."""
from __future__ import annotations

import argparse


def add_args(p: argparse.ArgumentParser) -> None:
    p.description = ("Load-test any OpenAI-compatible server (maxjax, vLLM, llama.cpp, ...) "
                     "with streaming requests, one load level at a time")
    p.epilog = ("exit status: 0 if every request succeeded, 1 if any failed (results are still "
                "written), 2 for a bad flag or an unreachable server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="The server (with or without /v1; default %(default)s)")
    p.add_argument("--model", help="Model name to send (default: the first one /v1/models lists)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default %(default)s)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="Comma-separated numbers of requests kept in flight, "
                      "one load level each (default 1)")
    load.add_argument("--request-rate", help="Comma-separated request rates (req/s, Poisson "
                      "arrivals), one load level each")
    p.add_argument("--num-prompts", type=int, help="Requests per level (default: 4 x concurrency, "
                   "at least 8; 32 with --request-rate)")
    p.add_argument("--input-len", type=int, help="Synthetic prompt length in tokens (default 128)")
    p.add_argument("--output-len", type=int, default=128,
                   help="Tokens to generate per request (max_tokens; default %(default)s)")
    p.add_argument("--dataset", help="JSONL prompts instead of synthetic ones: each line "
                   '{"prompt": TEXT} or {"messages": [...]} (chat), optionally "output_len" and '
                   '"prompt_tokens" (counted when the server reports no usage)')
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="Let requests stop at EOS (default: ignore_eos + min_tokens, so every "
                   "request generates exactly --output-len tokens where the server supports it)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default %(default)s)")
    p.add_argument("--warmup", action="store_true",
                   help="Before measuring each level, send one unmeasured round at its load "
                   "(concurrency-many requests; 4 at a request rate), so compilation and "
                   "cache warm-up stay out of the numbers")
    p.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrival times")
    p.add_argument("--timeout", type=float, default=1800, help="Seconds per request")
    p.add_argument("--result-json", help="Write the results here")
    p.add_argument("--plot", help="Write a PNG of throughput and TTFT against the load level")
    p.add_argument("--label", help="Series name in the plot and JSON (default: the model)")
    p.add_argument("--api-key", help="Sent as 'Authorization: Bearer KEY'")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="No progress bar")
