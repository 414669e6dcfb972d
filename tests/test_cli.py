"""The CLI: user errors are one line on stderr and exit code 2, never a traceback; `list`."""
import json
import os
import subprocess
import sys

import pytest

from maxjax import cli
from maxjax.models.loader import embedded_model_path


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, match, *argv):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("maxjax: error:")]
    assert len(lines) == 1 and match in lines[0], err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def truncated_gguf(tmp_path):
    with open(embedded_model_path(), "rb") as f:
        head = f.read(200_000)
    path = tmp_path / "cut.gguf"
    path.write_bytes(head)
    return str(path)


def test_bad_models_exit_2(capsys, tmp_path, truncated_gguf):
    one_line_error(capsys, "cannot be found", "generate", "--model", str(tmp_path / "no.gguf"),
                   "--prompt", "hi")
    one_line_error(capsys, "no config.json", "generate", "--model", str(tmp_path), "--prompt", "hi")
    one_line_error(capsys, "truncated", "generate", "--model", truncated_gguf, "--prompt", "hi")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    msg = one_line_error(capsys, "unsupported architecture", "generate", "--model", str(tmp_path),
                         "--prompt", "hi")
    assert "Llama" in msg and "...ForCausalLM" in msg


def test_bad_flags_exit_2(capsys, tmp_path):
    msg = one_line_error(capsys, "--quantization-encoding", "generate", "--prompt", "hi",
                         "--quantization-encoding", "q4_k")
    assert "float32" in msg
    one_line_error(capsys, "temperature", "generate", "--prompt", "hi", "--temperature", "-1")
    one_line_error(capsys, "--prompt", "generate")
    bad_pkg = tmp_path / "badarch"
    bad_pkg.mkdir()
    (bad_pkg / "__init__.py").write_text("X = 1\n")
    one_line_error(capsys, "ARCHITECTURES", "list", "--custom-architectures", str(bad_pkg))
    for argv in (["serve", "--no-such-flag"], ["--no-such-flag"]):
        with pytest.raises(SystemExit) as e:  # argparse: an unknown flag is an error, not ignored
            cli.main(argv)
        assert e.value.code == 2
        assert "--no-such-flag" in capsys.readouterr().err


def test_prompts_file_errors_name_the_cause(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "Yo"}]}\n')
    one_line_error(capsys, "line 2: 'messages' is a chat: add --chat", "generate",
                   "--prompts-file", str(f))
    f.write_text('{"text": "a"}\n')
    one_line_error(capsys, "line 1: needs a 'prompt'", "generate", "--prompts-file", str(f))
    f.write_text('{"prompt": \n')
    one_line_error(capsys, "line 1: not JSON", "generate", "--prompts-file", str(f))
    f.write_text('{"prompt": 5}\n{"prompt": 6}\n')     # two token ids were run as one prompt
    one_line_error(capsys, "line 1: 'prompt' must be a string or a non-empty list of token ids",
                   "generate", "--prompts-file", str(f))
    f.write_text('["x"]\n')
    one_line_error(capsys, "line 1: a JSON object with a 'prompt' field", "generate",
                   "--prompts-file", str(f))
    f.write_text('{"messages": "hi"}\n')
    one_line_error(capsys, "line 1: 'messages' must be a list", "generate", "--chat",
                   "--prompts-file", str(f))
    one_line_error(capsys, "--prompts-file", "generate", "--prompts-file", str(tmp_path / "no"))


def test_list(capsys):
    code, out, _ = run_cli(capsys, "list", "--json")
    names = {a["name"] for a in json.loads(out)}
    assert code == 0 and {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                          "MistralForCausalLM", "Gemma3ForCausalLM"} <= names
    rows = {a["name"]: a for a in json.loads(out)}
    assert rows["Gemma3ForConditionalGeneration"]["tasks"] == ["text", "vision"]
    assert rows["LlamaForCausalLM"]["loaders"] == ["hf", "gguf"]
    assert "q4_k" in rows["LlamaForCausalLM"]["encodings"]
    assert "q4_k" not in rows["GptOssForCausalLM"]["encodings"]
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "Gemma3ForCausalLM" in out and "text+vision" in out


def test_no_traceback_from_a_real_process(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "maxjax.cli", "generate", "--model",
                           str(tmp_path / "missing"), "--prompt", "hi"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "maxjax: error:" in proc.stderr


def test_a_failed_serve_says_nothing_of_a_server_it_never_ran(tmp_path):
    """`serve` binds its port before loading (/health answers 503 meanwhile); a start that
    fails ends on its one error line, with no drain or stop lines of a server that never ran."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "maxjax.cli", "serve", "--port", "0",
                           "--model", str(tmp_path / "missing.gguf")],
                          capture_output=True, text=True, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "cannot be found" in lines[-1], proc.stderr
    assert "draining" not in proc.stderr and "stopped" not in proc.stderr, proc.stderr


def test_chat_template_file_forms(tmp_path):
    from maxjax.errors import UserError
    from maxjax.models.loader import read_chat_template_file
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template_file(str(jinja)).startswith("{% for")
    js = tmp_path / "t.json"
    js.write_text(json.dumps({"chat_template": "X{{ messages[0].content }}"}))
    assert read_chat_template_file(str(js)) == "X{{ messages[0].content }}"
    js.write_text(json.dumps({"template": "no key"}))
    with pytest.raises(UserError, match="chat_template"):
        read_chat_template_file(str(js))
    with pytest.raises(UserError, match="--chat-template"):
        read_chat_template_file(str(tmp_path / "missing.jinja"))
    jinja.write_text("{% for m in messages %}{{ m.content }")     # served, then 400 every chat
    with pytest.raises(UserError, match=r"not a valid Jinja template \(line 1\): unexpected"):
        read_chat_template_file(str(jinja))
    jinja.write_text("{% generation %}{{ messages[0].content }}{% endgeneration %}")
    read_chat_template_file(str(jinja))         # transformers' own tags parse


def test_cache_list_as_json(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MAXJAX_CACHE_DIR", str(tmp_path))
    code, out, _ = run_cli(capsys, "cache", "list", "--json")
    assert code == 0 and json.loads(out) == {"directory": str(tmp_path),
                                             "max_bytes": 10 * 2**30, "entries": []}
    code, out, _ = run_cli(capsys, "cache", "list")
    assert "cap 10.0 GiB" in out


def test_config_file(capsys, tmp_path):
    import argparse

    from maxjax.cli.args import build, read_config_file
    from maxjax.cli.main import build_parser
    from maxjax.engine.config import EngineConfig
    parser = build_parser().parse_args(["serve"]).command_parser
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-batch-size: 4\nkv_cache_page_size: 16\n")
    values = read_config_file(str(cfg), parser)
    ns = argparse.Namespace(max_batch_size=8)            # the command line wins
    engine = build(EngineConfig, ns, values)
    assert engine.max_batch_size == 8 and engine.kv_cache_page_size == 16
    cfg.write_text("max-batch-sise: 4\n")
    one_line_error(capsys, "unknown settings: max-batch-sise", "generate", "--config-file",
                   str(cfg), "--prompt", "hi")


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "--port 70000: a port is 0-65535"),
    (["--port", "-1"], "--port -1: a port is 0-65535"),
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes must be >= 1"),
    (["--http-idle-timeout", "-1"], "--http-idle-timeout must be > 0 seconds"),
    (["--max-queue-size", "-1"], "--max-queue-size must be >= 0"),
    (["--device-memory-utilization", "1.5"], "--device-memory-utilization 1.5: a fraction"),
    (["--speculative-method", "draft", "--draft-model-path", "x", "--draft-devices", "gpu:3"],
     "--draft-devices gpu:3: the draft model runs on the target's platform (cpu)")])
def test_server_values_out_of_range_are_one_line(capsys, argv, words):
    one_line_error(capsys, words, "serve", *argv)


def test_a_cache_directory_that_is_a_file_is_one_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "f").write_text("")
    monkeypatch.setenv("MAXJAX_CACHE_DIR", str(tmp_path / "f"))
    one_line_error(capsys, f"$MAXJAX_CACHE_DIR {tmp_path / 'f'}: not a directory", "generate",
                   "--prompt", "hi")


def test_warm_cache_takes_a_serve_command_line(tmp_path):
    from maxjax.cli.args import read_config_file
    from maxjax.cli.main import build_parser
    args = build_parser().parse_args(["warm-cache", "--port", "8100", "--host", "0.0.0.0",
                                      "--max-queue-size", "64"])
    assert (args.port, args.host, args.max_queue_size) == (8100, "0.0.0.0", 64)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 8100\nserved-model-name: m\n")
    assert read_config_file(str(cfg), args.command_parser) == {"port": 8100,
                                                               "served_model_name": "m"}


def test_task_takes_the_reference_spelling():
    from maxjax.cli.main import build_parser
    for text, want in (("PipelineTask.EMBEDDINGS_GENERATION", "embeddings_generation"),
                       ("pipelinetask.text_generation", "text_generation"),
                       ("text_generation", "text_generation")):
        assert build_parser().parse_args(["serve", "--task", text]).task == want


def test_an_unknown_log_level_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--log-level", "bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--log-level: invalid choice: 'bogus'" in err
    assert len(err.strip().splitlines()) == 1


def test_config_file_values_parse_as_the_flags_do(capsys, tmp_path):
    """A value goes through its flag's parsing (the words, the types, the choices, one value
    for a list) and a key may be any of the flag's names, the reference's included."""
    from maxjax.cli.args import read_config_file
    from maxjax.cli.main import build_parser
    parser = build_parser().parse_args(["serve"]).command_parser
    cfg = tmp_path / "c.yaml"
    cfg.write_text("enable_prefix_caching: 'false'\nmax-length: '4096'\nmodel: m.gguf\n"
                   "precompiled_mefs: /a\ncustom-architectures: /x\npretty-print-config: on\n"
                   "port: 8100\ntemperature: 1\n")
    assert read_config_file(str(cfg), parser) == {
        "enable_prefix_caching": False, "max_length": 4096, "model_path": "m.gguf",
        "precompiled_artifacts": ["/a"], "custom_architectures": ["/x"],
        "pretty_print_config": True, "port": 8100, "temperature": 1.0}
    for text, words in [("max_length: abc", "max_length: invalid int value"),
                        ("max_batch_size: 16.5", "max_batch_size: invalid int value"),
                        ("devices: [cpu]", "devices: expected one value"),
                        ("task: pixel_generation", "task: invalid choice 'pixel_generation'"),
                        ("enable_echo: maybe", "enable_echo: expected true or false")]:
        cfg.write_text(text + "\n")
        one_line_error(capsys, words, "serve", "--config-file", str(cfg))


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_mef_flags_are_aliases_of_the_artifact_flags(command):
    from maxjax.cli.args import ModelOptions, build
    from maxjax.cli.main import build_parser

    def options(*argv):
        return build(ModelOptions, build_parser().parse_args([command, *argv]))
    mefs = options("--precompiled-mefs", "a", "b", "--export-mefs", "out")
    assert (mefs.precompiled_artifacts, mefs.export_artifacts) == (["a", "b"], "out")
    assert mefs == options("--precompiled-artifacts", "a", "b", "--export-artifacts", "out")
    assert options("--precompiled-mefs", "a", "--precompiled-artifacts", "b").precompiled_artifacts \
        == ["a", "b"]


def test_serve_turns_the_collector_back_on_when_its_start_fails(capsys):
    """`maxjax serve` starts with the garbage collector off (maxjax/cli/main.py); a start that
    fails on a flag leaves it on, as does the end of a start (settle_heap: collected, frozen)."""
    import gc

    from maxjax.cli.serve import settle_heap
    one_line_error(capsys, "--quantization-encoding", "serve", "--quantization-encoding", "q4_k")
    assert gc.isenabled()
    gc.disable()
    try:
        settle_heap()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_host_that_is_no_address_is_named():
    proc = subprocess.run([sys.executable, "-m", "maxjax.cli", "serve", "--host", "bogus.invalid",
                           "--port", "0", "--no-compile-cache"], capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("maxjax: error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and "--host bogus.invalid: not an address" in lines[0], lines


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`maxjax list | head -1`: the pipe closes before the output is written."""
    proc = subprocess.Popen([sys.executable, "-m", "maxjax.cli", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err
