"""What the image-text model tests share: PNG images made here, and a word tokenizer holding
the checkpoint's image tokens at their config ids."""
from __future__ import annotations

import io

import numpy as np


def png(seed: int, shape) -> bytes:
    """A random RGB image of `shape` (height, width, 3), as PNG bytes."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def write_word_tokenizer(path, vocab_size: int, special: dict, ids: dict) -> None:
    """<unk>, <s>, </s> at 0-2, "w{i}" at each other id, and the special tokens (name ->
    token) at `ids` (name -> id), saved to `path` as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    taken = set(ids.values())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2,
             **{f"w{i}": i for i in range(3, vocab_size) if i not in taken}}
    vocab.update({special[name]: i for name, i in ids.items()})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", extra_special_tokens=special).save_pretrained(path)


# int8 weights (the text decoder's: the image encoder stays float) against float32 on the same
# image prompt: perplexity within 5% (measured: see each test's output).
INT8_PPL_RATIO = 1.05


def perplexity(core, ids: list[int], images: list) -> float:
    """exp(-mean prompt-token logprob) of one prompt with its images, through `core`."""
    from maxjax.engine.types import SamplingParams
    rid = f"ppl-{len(core.scheduler.requests)}-{id(ids)}"
    core.add_request(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=1,
                                              prompt_logprobs=True), images=images)
    got = None
    while core.has_unfinished():
        for out in core.step():
            if out.request_id == rid:
                got = out.prompt_logprobs or got
    return float(np.exp(-np.mean([lp.logprob for lp in got[1:]])))


def load(path, encoding: str = "float32"):
    from maxjax.models.loader import load_model
    return load_model(str(path), encoding, progress=False)


def engine_core(model, engine: dict):
    """A warmed-up EngineCore of `model` with the test's engine options."""
    from maxjax.engine.build import build_core
    from maxjax.engine.config import EngineConfig
    return build_core(model, EngineConfig(**engine))


def int8_core(path, engine: dict):
    return engine_core(load(path, "int8"), engine)
