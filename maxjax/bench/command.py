"""`maxjax benchmark`: load-test any OpenAI-compatible server (maxjax, vLLM, llama.cpp, ...) with
streaming requests, one load level at a time: a fixed number of requests in flight
(--concurrency 1,8,32) or Poisson arrivals (--request-rate R). Per level it reports requests/s,
output and total tokens/s, TTFT / TPOT / ITL / end-to-end latency (mean, p50, p90, p99) and
errors, as a table, a JSON file (--result-json) and a PNG plot (--plot, needs matplotlib).

maxjax/cli/main.py calls `flags.add_args(subparser)` and `main(args)`. The HTTP side is in
maxjax/bench/client.py, the statistics and plot in maxjax/bench/report.py.

Exit status: 0 when every request succeeded; 1 when any failed (the table, the JSON file and the
plot are still written, and the first error messages are printed), so scripts notice a broken
run; 2 for a bad flag or an unreachable server (UserError).
"""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import random
import sys
import time

import aiohttp

from maxjax.bench import client
from maxjax.bench import report
from maxjax.errors import UserError


def _numbers(flag: str, text: str, kind) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated positive numbers") from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"{flag} {text!r}: expected comma-separated positive numbers")
    return values


def check_args(args) -> list[dict]:
    """Validate the flags; return the load levels ({"concurrency": C} or {"request_rate": R})."""
    if args.request_rate:
        levels = [{"request_rate": r} for r in _numbers("--request-rate", args.request_rate, float)]
    else:
        levels = [{"concurrency": c}
                  for c in _numbers("--concurrency", args.concurrency or "1", int)]
    for flag, v in (("--num-prompts", args.num_prompts), ("--input-len", args.input_len),
                    ("--output-len", args.output_len)):
        if v is not None and v < 1:
            raise UserError(f"{flag} {v}: must be at least 1")
    if args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout}: must be positive")
    if args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: must be >= 0")
    if args.dataset and args.input_len is not None:
        raise UserError("--input-len and --dataset exclude each other (the dataset sets the "
                        "prompts)")
    for flag, path in (("--result-json", args.result_json), ("--plot", args.plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UserError(f"{flag} {path}: no such directory")
    if not args.base_url.startswith(("http://", "https://")):
        raise UserError(f"--base-url {args.base_url!r}: expected http://HOST:PORT")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (fail before the run, not after it)
        except ImportError:
            raise UserError("--plot needs matplotlib: pip install matplotlib") from None
    return levels


def read_dataset(path: str, endpoint: str, output_len: int) -> list[client.Prompt]:
    try:
        with open(path) as f:
            lines = [(i, ln) for i, ln in enumerate(f, 1) if ln.strip()]
    except OSError as e:
        raise UserError(f"--dataset {path}: {e.strerror}") from e
    prompts = []
    for i, line in lines:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--dataset {path} line {i}: not JSON ({e})") from e
        if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str)
                                             or isinstance(obj.get("messages"), list)):
            raise UserError(f"--dataset {path} line {i}: needs a 'prompt' string or a 'messages' "
                            "list")
        if obj.get("prompt") is None and endpoint != "chat":
            raise UserError(f"--dataset {path} line {i}: 'messages' needs --endpoint chat")
        n = obj.get("output_len", output_len)
        if not isinstance(n, int) or n < 1:
            raise UserError(f"--dataset {path} line {i}: output_len must be a positive integer")
        tokens = obj.get("prompt_tokens")
        if tokens is not None and (not isinstance(tokens, int) or tokens < 1):
            raise UserError(f"--dataset {path} line {i}: prompt_tokens must be a positive integer")
        prompts.append(client.Prompt(text=obj.get("prompt"), messages=obj.get("messages"),
                                     tokens=tokens, output_len=n))
    if not prompts:
        raise UserError(f"--dataset {path}: no prompts")
    return prompts


async def _pick_model(session: aiohttp.ClientSession, root: str, wanted: str | None) -> str:
    try:
        async with session.get(f"{root}/v1/models", timeout=client.PROBE_TIMEOUT) as r:
            body = await r.json(content_type=None) if r.status == 200 else None
            status = r.status
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        raise UserError(f"cannot reach the server at {root}: {str(e) or type(e).__name__}") from e
    if status == 503:
        raise UserError(f"{root}/v1/models answered 503: the server is still loading; retry "
                        "when /health answers 200")
    if status in (401, 403):
        raise UserError(f"{root}/v1/models answered {status}: the server wants an API key "
                        "(--api-key)")
    served = [m.get("id") for m in (body or {}).get("data", []) if isinstance(m, dict)]
    if wanted:
        if served and wanted not in served:
            print(f"warning: /v1/models lists {served}, not {wanted!r}", file=sys.stderr)
        return wanted
    if not served:
        raise UserError(f"{root}/v1/models answered {status} without a model list: pass --model")
    return served[0]


class Run:
    """One benchmark: shared session, prompt source and results across load levels."""

    def __init__(self, args, levels: list[dict]):
        self.args, self.levels = args, levels
        self.root = client.api_root(args.base_url)
        self.url = self.root + ("/v1/chat/completions" if args.endpoint == "chat"
                                else "/v1/completions")
        self.rng = random.Random(args.seed)
        self.dataset = (read_dataset(args.dataset, args.endpoint, args.output_len)
                        if args.dataset else None)
        self.next_item = 0
        self.tokenizer = None

    def num_prompts(self, level: dict) -> int:
        if self.args.num_prompts:
            return self.args.num_prompts
        return max(8, 4 * level["concurrency"]) if "concurrency" in level else 32

    async def prompts(self, n: int) -> list[client.Prompt]:
        if self.dataset:
            out = [self.dataset[(self.next_item + i) % len(self.dataset)] for i in range(n)]
            self.next_item += n
            return out
        input_len = self.args.input_len or 128
        return [await client.synthetic_prompt(self.tokenizer, self.rng, input_len,
                                              self.args.output_len) for _ in range(n)]

    async def one(self, session, prompt: client.Prompt) -> client.RequestResult:
        body = client.request_body(self.args.endpoint, self.model, prompt, self.args.ignore_eos,
                                   self.args.temperature)
        return await client.send_request(session, self.url, self.args.endpoint, body, prompt)

    async def level(self, session, level: dict, prompts: list, bar=None) -> tuple[list, float]:
        """Send `prompts` at this load; (results, seconds from the first send to the last end)."""
        results: list = [None] * len(prompts)

        async def run(i, p):
            results[i] = await self.one(session, p)
            if bar is not None:
                bar.update(1)

        t0 = time.perf_counter()
        if "concurrency" in level:
            gate = asyncio.Semaphore(level["concurrency"])

            async def gated(i, p):
                async with gate:
                    await run(i, p)
            await asyncio.gather(*(gated(i, p) for i, p in enumerate(prompts)))
        else:
            tasks = []
            for i, p in enumerate(prompts):
                if i:
                    await asyncio.sleep(self.rng.expovariate(level["request_rate"]))
                tasks.append(asyncio.create_task(run(i, p)))
            await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0

    async def run(self) -> list[dict]:
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.args.timeout)
        # A connection per request: a pooled keep-alive connection the server has just closed
        # (llama-server's cpp-httplib does after 5 s idle) fails the POST with "Can not write
        # request body"; a localhost connect costs well under a millisecond.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                         connector=connector) as session:
            self.model = await _pick_model(session, self.root, self.args.model)
            if not self.dataset:
                self.tokenizer = await client.RemoteTokenizer.probe(session, self.root)
                if self.tokenizer is None:
                    print("note: the server has no /tokenize endpoint: prompts are "
                          f"{self.args.input_len or 128} words, and the input token counts "
                          "reported are the server's", file=sys.stderr)
            summaries = []
            for level in self.levels:
                if self.args.warmup:
                    n = level.get("concurrency", 4)
                    await self.level(session, level, await self.prompts(n))
                prompts = await self.prompts(self.num_prompts(level))
                bar = _progress(self.args.progress, len(prompts), report.level_label(level))
                try:
                    results, seconds = await self.level(session, level, prompts, bar)
                finally:
                    if bar is not None:
                        bar.close()
                summaries.append(report.summarize(results, seconds, **level))
            return summaries


def _progress(enabled: bool, total: int, label: str):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)


def main(args) -> int:
    levels = check_args(args)
    run = Run(args, levels)
    summaries = asyncio.run(run.run())
    label = args.label or run.model
    result = {
        "label": label, "base_url": args.base_url, "model": run.model, "endpoint": args.endpoint,
        "input_len": None if args.dataset else (args.input_len or 128),
        "output_len": args.output_len, "dataset": args.dataset, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature, "seed": args.seed, "warmup": args.warmup,
        "tokenizer": run.tokenizer.flavour if run.tokenizer else None,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "levels": summaries,
    }
    workload = (f"dataset {args.dataset}" if args.dataset else
                f"{result['input_len']} input tokens"
                + ("" if run.tokenizer else " (approximated by words)"))
    print(f"{label} at {args.base_url} /v1/{'chat/' if args.endpoint == 'chat' else ''}"
          f"completions: {workload}, {args.output_len} output tokens"
          f"{' (ignore_eos)' if args.ignore_eos else ''}")
    print(report.text_table(*report.throughput_rows(summaries)))
    print()
    print(report.text_table(*report.latency_rows(summaries)))
    if args.result_json:
        try:
            with open(args.result_json, "w") as f:
                json.dump(result, f, indent=2)
        except OSError as e:
            raise UserError(f"--result-json {args.result_json}: {e.strerror}") from e
    if args.plot:
        report.plot({label: summaries}, args.plot,
                    title=f"{label}: {workload}, {args.output_len} output tokens")
    short = sum(s["short_outputs"] for s in summaries)
    if short and args.ignore_eos:
        print(f"warning: {short} requests stopped before max_tokens although ignore_eos and "
              "min_tokens were sent: the server ignores both, or cut streams short (throughput "
              "counts the tokens actually generated)", file=sys.stderr)
    failed = sum(s["errors"] for s in summaries)
    if failed:
        total = sum(s["num_requests"] for s in summaries)
        print(f"{failed} of {total} requests failed:", file=sys.stderr)
        for s in summaries:
            for msg in s["error_samples"]:
                print(f"  [{report.level_label(s)}] {msg}", file=sys.stderr)
        return 1
    return 0
