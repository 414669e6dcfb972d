"""maxjax/transformers_index.py: transformers' lazy index read from the compile cache gives the
same module as the scan, and never stands in the way (a damaged file is rebuilt; the cache off,
or transformers already imported, leaves it alone). Each case is a fresh interpreter."""
import glob
import json
import os
import pickle
import subprocess
import sys

# The index as transformers' lazy module holds it (class name -> module), and where it came from.
PROBE = r"""
import json, sys
from maxjax import transformers_index
transformers_index.install()
import transformers
from transformers.utils import import_utils
print(json.dumps({
    "hooked": import_utils.define_import_structure.__module__ == "maxjax.transformers_index",
    "classes": sorted(transformers._class_to_module.items()),
    "tokenizer": transformers.PreTrainedTokenizerFast.__name__,
}))
"""


def _probe(cache: str, **env) -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env={**os.environ, "MAXJAX_CACHE_DIR": cache, **env}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _scanned() -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE.replace("transformers_index.install()",
                                                               "")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _entries(cache: str) -> list[str]:
    return glob.glob(os.path.join(cache, ".transformers-index-*.pickle"))


def test_the_stored_index_is_the_scanned_one(tmp_path):
    cache = str(tmp_path)
    scanned = _scanned()
    assert not scanned["hooked"] and len(scanned["classes"]) > 1000
    first = _probe(cache)                       # scans and stores
    [entry] = _entries(cache)
    second = _probe(cache)                      # reads the file
    assert first["hooked"] and second["hooked"]
    assert first["classes"] == scanned["classes"] == second["classes"]
    assert first["tokenizer"] == scanned["tokenizer"] == second["tokenizer"]
    assert _entries(cache) == [entry]
    # the file is what a start reads: a class taken out of it is gone from transformers
    with open(entry, "rb") as f:
        index = pickle.load(f)
    for modules in index.values():
        for names in modules.values():
            names.discard("LlamaConfig")
    with open(entry, "wb") as f:
        pickle.dump(index, f)
    names = {name for name, _ in _probe(cache)["classes"]}
    assert "LlamaConfig" not in names and "MistralConfig" in names


def test_a_damaged_index_is_scanned_again_and_replaced(tmp_path):
    cache = str(tmp_path)
    want = _probe(cache)["classes"]
    [entry] = _entries(cache)
    with open(entry, "wb") as f:
        f.write(b"\x80\x05not a pickle")
    assert _probe(cache)["classes"] == want
    with open(entry, "rb") as f:
        assert pickle.load(f)


def test_the_cache_off_stores_nothing(tmp_path):
    cache = str(tmp_path)
    got = _probe(cache, MAXJAX_NO_COMPILE_CACHE="1")
    assert not got["hooked"] and _entries(cache) == []


def test_installed_after_transformers_is_a_no_op():
    import transformers  # noqa: F401 (this process has it already)
    from maxjax import transformers_index
    transformers_index.install()
    assert transformers_index._finder not in sys.meta_path
