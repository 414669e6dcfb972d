"""load_model and --custom-architectures errors a user can cause: each a UserError with a clear
one-line message (the CLI prints it and exits 2)."""
import json
import textwrap
import uuid

import pytest

from maxjax.models import registry
from maxjax.errors import UserError
from maxjax.models.loader import embedded_model_path, load_model


def raises_one_line(match, fn, *args, **kwargs):
    with pytest.raises(UserError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)
    return str(e.value)


def test_missing_path(tmp_path):
    raises_one_line("cannot be found", load_model, str(tmp_path / "nope.gguf"), "float32")
    raises_one_line("cannot be found", load_model, "./no/such/dir", "float32")


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    raises_one_line("no config.json", load_model, str(tmp_path), "float32")


def test_truncated_gguf(tmp_path):
    with open(embedded_model_path(), "rb") as f:
        head = f.read(64 << 20)
    header_cut, data_cut = tmp_path / "header.gguf", tmp_path / "data.gguf"
    header_cut.write_bytes(head[:200_000])       # inside the tokenizer metadata
    data_cut.write_bytes(head)                   # header whole, tensor data cut short
    raises_one_line("truncated", load_model, str(header_cut), "float32")
    raises_one_line("truncated GGUF file", load_model, str(data_cut), "float32")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model")
    raises_one_line("not a GGUF file", load_model, str(path), "float32")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    msg = raises_one_line("unsupported architecture 'FooForCausalLM'", load_model, str(tmp_path),
                          "float32")
    assert "Llama" in msg and "...ForCausalLM" in msg and "--custom-architectures" in msg


def test_config_without_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    raises_one_line("no 'architectures'", load_model, str(tmp_path), "float32")


def test_unsupported_quantization_encoding():
    msg = raises_one_line("unsupported --quantization-encoding 'q4_2'", load_model, None, "q4_2")
    assert "float32" in msg and "bfloat16" in msg
    msg = raises_one_line("--quantization-encoding q4_k: the checkpoint holds no Q4_K weights",
                          load_model, None, "q4_k")
    assert "q4_1" in msg and "int8" in msg


def test_custom_architectures_without_list(tmp_path):
    pkg = tmp_path / "no_archs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    raises_one_line("no top-level ARCHITECTURES", registry.register_custom, str(pkg))


def test_custom_architectures_bad_entries(tmp_path):
    (tmp_path / "bad_entry.py").write_text("ARCHITECTURES = ['not an architecture']\n")
    raises_one_line("expected maxjax.graphs.arch.Architecture", registry.register_custom,
                    str(tmp_path / "bad_entry.py"))
    (tmp_path / "broken.py").write_text("import no_such_module_anywhere\n")
    raises_one_line("import failed: ModuleNotFoundError", registry.register_custom,
                    str(tmp_path / "broken.py"))
    raises_one_line("no such directory or file", registry.register_custom,
                    str(tmp_path / "missing") + "/")
    nodir = tmp_path / "no_init"
    nodir.mkdir()
    raises_one_line("no __init__.py", registry.register_custom, str(nodir))


def test_custom_architecture_registers(tmp_path):
    name = f"Custom{uuid.uuid4().hex[:8]}ForCausalLM"
    pkg = tmp_path / "my_archs"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        from maxjax.graphs import decoder
        from maxjax.graphs.arch import Architecture, base_config

        def config_from_hf(hf):
            return base_config(hf)

        ARCHITECTURES = [Architecture("{name}", config_from_hf, forward=decoder.forward,
                                      description="test custom")]
    """))
    archs = registry.register_custom(str(pkg))
    assert [a.name for a in archs] == [name]
    assert name in registry.architectures()
    assert registry.get_architecture(name).description == "test custom"
    raises_one_line("clashes with a registered architecture", registry.register_custom, str(pkg))


def test_config_an_architecture_rejects(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": True, "vocab_size": 8,
        "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}))
    raises_one_line("unsupported config: Qwen3 with attention_bias", load_model, str(tmp_path), "float32")


def test_generation_config_eos_ends_generation_too(tmp_path):
    """An instruct checkpoint's end-of-turn id often sits only in generation_config.json."""
    from maxjax.graphs.arch import eos_ids
    from maxjax.models.hf import read_config
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 333]}))
    assert eos_ids(read_config(str(tmp_path))) == (2, 333)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 333}))
    assert eos_ids(read_config(str(tmp_path))) == (333,)
    (tmp_path / "generation_config.json").write_text("{")
    raises_one_line("unreadable generation_config.json", read_config, str(tmp_path))


def test_a_single_file_is_read_before_an_index_beside_it(tmp_path):
    from maxjax.models.hf import safetensors_files
    for name in ("model.safetensors", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert safetensors_files(str(tmp_path)) == [str(tmp_path / "model.safetensors")]
    (tmp_path / "model.safetensors").unlink()
    assert len(safetensors_files(str(tmp_path))) == 2


def test_a_directory_without_tokenizer_files_says_so(tmp_path):
    from maxjax.models.loader import load_hf_tokenizer
    (tmp_path / "config.json").write_text("{}")
    raises_one_line("no tokenizer files", load_hf_tokenizer, str(tmp_path))
