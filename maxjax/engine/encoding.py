"""The weights' encoding: the planner's decision (maxjax/engine/plan.py `Prepared.with_header`),
from --quantization-encoding, the checkpoint header's facts (its 2-D tensor types, its
architecture: maxjax/models/loader.py `Checkpoint`), whether the CPU kernels run and the
platform the graphs run on. The loader converts the weights to what this returns and decides
nothing; `maxjax suggest` reports the same choice.
"""
from __future__ import annotations

from maxjax.models import quantize


def default_dtype(platform: str) -> str:
    """A float checkpoint's encoding on `platform` (export names: cpu, cuda, rocm, tpu): float32
    on the CPU (XLA:CPU's bf16 matrix-vector products are ~15x slower, DESIGN.md), bfloat16 on
    an accelerator."""
    return "float32" if platform == "cpu" else "bfloat16"


def weights_encoding(asked: str | None, header, platform: str, kernels: bool) -> str:
    """The encoding the weights are served in: `asked` (--quantization-encoding) checked against
    the checkpoint `header` (a UserError naming the flag when it cannot be served from it), else
    its default: for a quantized GGUF int8, or its own 4-bit blocks where the CPU kernels run
    (`kernels`), else `default_dtype(platform)`."""
    if asked is None:
        asked = quantize.gguf_encoding(header.types, kernels) if header.types is not None else \
            default_dtype(platform)
    quantize.check_encoding(asked, header.types, header.arch)
    return asked


def draft_encoding(cfg, target_encoding: str, header, platform: str) -> str:
    """The draft model's (maxjax/engine/draft.py): --draft-quantization-encoding, else the
    target's float encoding; a quantized target's may not exist in the draft's checkpoint, which
    then takes its own default. The CPU kernels are never packed for a draft."""
    same = target_encoding if target_encoding in quantize.FLOAT_ENCODINGS else None
    return weights_encoding(cfg.draft_quantization_encoding or same, header, platform, False)
