import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Engines built by different tests share graph shapes: a session-wide persistent compilation cache
# turns the second compile of the same graph into a load.
_cache = os.environ.get("MAXJAX_TEST_JAX_CACHE") or tempfile.mkdtemp(prefix="maxjax-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
