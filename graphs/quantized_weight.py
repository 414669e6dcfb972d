"""The QuantizedWeight pytree: a quantized matrix's arrays (formats: graphs/quant.py, which
computes with it; graphs/cpu_kernels.py packs it for its kernels). Its own module so that both
import it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax


@jax.tree_util.register_dataclass
@dataclass
class QuantizedWeight:
    q: jax.Array                 # int8 [in, out] (bits 8) or packed uint8 [in/2, out] (bits 4);
                                 # 4-D: packed for graphs/cpu_kernels.py
    scale: jax.Array             # float32 [out] (bits 8) or [in/32, out] (bits 4)
    offset: jax.Array | None = None    # float32 [in/32, out] (bits 4, GGUF formats with a min)
    requant: jax.Array | None = None   # float32 [out]: 127 / max|w| per channel (bits 4)
    bits: int = field(default=8, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The [in, out] (or, transposed, [out, in]) shape of the weight it stands for; a stack
        of experts' int8 weights (graphs/moe.py): q [E, in, out], scale [E, out]."""
        if self.q.ndim == 3:
            return tuple(self.q.shape)
        if self.q.ndim == 4:                        # packed for the CPU kernels: [in, out]
            return self.q.shape[1] * (4 if self.bits == 8 else 8), self.q.shape[0] * 64
        rows, cols = self.q.shape
        return (rows * 2, cols) if self.bits == 4 else (rows, cols)
