"""The README and docs/ are checked, so that they cannot go stale: every relative link (and its
#anchor) resolves, every flag a `maxjax` command line shows exists in that command's parser, every
flag named in backticks exists in some maxjax command, and the cheap commands they show run as
shown (`maxjax list`, `maxjax suggest`, `hf download --help`, each command's `--help`)."""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from maxjax.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
FRONT = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAXJAX_BIN = Path(sys.executable).parent / "maxjax"

# Flags in backticks that are not maxjax's: other programs' (pip, npm, pytest, XLA, tools/fuzz.py's
# `--url`), or patterns (a `--draft-*` twin, a boolean's `--x` / `--no-x`).
NOT_MAXJAX = {"--no-deps", "--collect-only", "--durations", "--xla_cpu_max_isa",
              "--xla_cpu_experimental_ynn_fusion_type", "--url", "--draft-", "--x", "--no-x"}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_readme_or_another_page():
    linked = set()
    for page in FRONT:
        for target in _links(page):
            path = target.partition("#")[0]
            if path:
                linked.add((page.parent / path).resolve())
    orphans = [p.name for p in FRONT[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages nothing links to: {orphans}"


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def _command_lines(text: str):
    """(command, the rest of the line) for each `maxjax COMMAND ...` in code blocks (lines joined
    at a trailing backslash) and inline code spans; `make serve ARGS="..."` counts as serve."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    lines = [ln for b in blocks for ln in b.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    lines += re.findall(r"`([^`\n]+)`", prose)
    for line in lines:
        line = line.split("#", 1)[0] if line.lstrip().startswith(("maxjax", "$")) else line
        for m in re.finditer(r"(?:^|[\s/$(])maxjax ([a-z][a-z-]*)(.*?)(?=$|\||&&|;|\))", line):
            yield m.group(1), m.group(2)
        m = re.search(r"make serve ARGS=\"([^\"]*)\"", line)
        if m:
            yield "serve", m.group(1)


@pytest.mark.parametrize("page", FRONT, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_a_maxjax_command_line_shows_exists(page):
    parsers = _parsers()
    wrong = []
    for command, rest in _command_lines(page.read_text()):
        if command == "cache" and re.match(r"\s*(list|clear)\b", rest):
            pass
        elif command not in parsers:
            wrong.append(f"maxjax {command}: no such command")
            continue
        known = _options(parsers[command])
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
            if flag not in known:
                wrong.append(f"maxjax {command} {flag}")
    assert not wrong, f"{page.name}: flags the CLI does not have: {sorted(set(wrong))}"


def test_the_command_line_reader_finds_what_it_checks():
    """The reader above sees flags in code blocks, continued lines and inline spans (a reader
    that found nothing would pass every page)."""
    text = ("```bash\nmaxjax serve --model M \\\n  --max-length 8   # a comment --bogus\n```\n"
            "and `maxjax warm-cache --artifacts-dir DIR` or `make serve ARGS=\"--port 1\"`")
    got = [(c, re.findall(r"--[a-z-]+", r)) for c, r in _command_lines(text)]
    assert got == [("serve", ["--model", "--max-length"]), ("warm-cache", ["--artifacts-dir"]),
                   ("serve", ["--port"])]


@pytest.mark.parametrize("page", FRONT, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_named_in_backticks_is_a_maxjax_flag(page):
    """A flag named in prose (`--num-kv-pages`) is one of maxjax's commands' flags, so a renamed
    or removed flag cannot stay in the docs."""
    known = set().union(*(_options(p) for p in _parsers().values()))
    prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    unknown = set()
    for span in re.findall(r"`([^`\n]+)`", prose):
        if re.search(r"tools/|pytest|pip |npm |llama-server|XLA_FLAGS|compare_peers", span):
            continue
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*)", span):
            if flag not in known and flag not in NOT_MAXJAX:
                unknown.add(flag)
    assert not unknown, f"{page.name}: not a flag of any maxjax command: {sorted(unknown)}"


def test_each_command_help_renders():
    for name, p in _parsers().items():
        text = p.format_help()
        assert name in text and "--help" in text, name


def test_the_capability_table_counts_the_architectures_maxjax_lists():
    from maxjax.models import registry
    names = {a.name for a in registry.builtin_architectures()}   # not other tests' customs
    readme = (ROOT / "README.md").read_text()
    count = int(re.search(r"\| (\d+) architectures", readme).group(1))
    table = re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "models.md").read_text(), flags=re.M)
    assert count == len(names)
    assert set(table) == names


def _run(*args, cache_dir, timeout=300):
    env = dict(os.environ, MAXJAX_CACHE_DIR=str(cache_dir))
    return subprocess.run([str(MAXJAX_BIN), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.mark.slow
def test_maxjax_list_runs_as_shown(tmp_path):
    r = _run("list", "--json", cache_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    listed = {a["name"] for a in json.loads(r.stdout)}
    table = re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "models.md").read_text(), flags=re.M)
    assert listed == set(table)


@pytest.mark.slow
def test_the_suggest_sample_has_the_fields_suggest_prints(tmp_path):
    """docs/models.md's sample of `maxjax suggest` shows the lines the command prints, in its
    order (the values are this machine's; the fields must not go stale)."""
    text = (ROOT / "docs" / "models.md").read_text()
    sample = re.search(r"```\n\$ maxjax suggest\n(.*?)```", text, flags=re.S).group(1)
    r = _run("suggest", cache_dir=tmp_path)      # an empty cache, as in the sample
    assert r.returncode == 0, r.stderr

    def fields(out):
        return [ln.split("  ")[0] for ln in out.splitlines() if ln and not ln.startswith("#  -")]
    assert fields(sample) == fields(r.stdout)
    assert r.stdout.rstrip().splitlines()[-1] == sample.rstrip().splitlines()[-1] == "maxjax serve"


@pytest.mark.skipif(shutil.which("hf", path=str(MAXJAX_BIN.parent)) is None,
                    reason="huggingface_hub's hf CLI not installed")
def test_hf_download_as_the_readme_shows_it():
    hf = shutil.which("hf", path=str(MAXJAX_BIN.parent))
    r = subprocess.run([hf, "download", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "repo_id" in r.stdout.lower().replace("-", "_"), r.stderr
    assert "hf download HuggingFaceTB/SmolLM2-360M-Instruct" in (ROOT / "README.md").read_text()


def _requests(text: str):
    """(method, path, body or None, the sample that follows or '') for each `curl` of
    http://127.0.0.1:8000 in a code block, without a pipe; the sample is the next block if it is
    JSON."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)
    for i, (_, code) in enumerate(blocks):
        for cmd in re.split(r"\n(?=curl )", code.replace("\\\n", " ")):
            m = re.match(r"curl [^\n]*?http://127\.0\.0\.1:8000(/[\w/.-]*)", cmd)
            if not m or "|" in cmd.splitlines()[0]:
                continue
            body = re.search(r"-d '(.*?)'", cmd, flags=re.S)
            sample = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "json" else ""
            yield ("POST" if body else "GET"), m.group(1), body and json.loads(body.group(1)), sample


def _keys(obj) -> set[str]:
    if isinstance(obj, dict):
        return set(obj).union(*(_keys(v) for v in obj.values()))
    if isinstance(obj, list):
        return set().union(*(_keys(v) for v in obj))
    return set()


def _python_snippets(text: str):
    for code in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        if 'base_url="http://127.0.0.1:8000' in code:
            yield code


@pytest.mark.slow
def test_the_docs_requests_run_against_a_server(smollm2_chat):
    """Every curl and client snippet the README and docs/ show for the embedded model runs
    against a server of it: a 200 (exit 0), and a response with every key its sample shows."""
    import httpx
    _, server = smollm2_chat
    ran, wrong = 0, []
    for page in FRONT:
        text = page.read_text().replace("SmolLM2-135M-Instruct", "smollm2")
        for method, path, body, sample in _requests(text):
            if path in ("/v1/load_lora_adapter",) or (body or {}).get("model", "smollm2") != "smollm2":
                continue
            r = httpx.request(method, server.url + path, json=body, timeout=300)
            ran += 1
            if r.status_code != 200:
                wrong.append(f"{page.name}: {method} {path}: {r.status_code} {r.text[:200]}")
                continue
            missing = set(re.findall(r'"(\w+)":', sample)) - _keys(r.json())
            if missing:
                wrong.append(f"{page.name}: {path}: the sample's {sorted(missing)} not in the response")
        for code in _python_snippets(text):
            code = code.replace("http://127.0.0.1:8000", server.url)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               timeout=300)
            ran += 1
            if r.returncode != 0:
                wrong.append(f"{page.name}: a snippet failed: {r.stderr[-400:]}")
    assert ran >= 8 and not wrong, wrong
