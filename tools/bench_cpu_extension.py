"""The CPU kernels' linears with their ISA's extension against without it (graphs/cpu_kernels.py
EXTENSIONS: avx512's AMX-INT8 tiles, graphs/kernels/quant_linear_amx.h; avx2's AVX-VNNI, in
quant_linear.cc), in one process, the two interleaved call by call: SmolLM2-135M's matrices
(random values in the embedded GGUF's encodings: the 4-bit blocks of q|k|v, o, gate|up and down,
the int8 rows of the tied LM head; `--layers int8`: the layers in int8 too, as
`--quantization-encoding int8` serves them) at each row count, and a step's worth of them (30
layers and the head). The outputs are checked equal to the bit on the way.

    .venv/bin/python tools/bench_cpu_extension.py [--isa avx512|avx2] [--rows 8,16,32,64,256]
        [--iters 40] [--layers int8]
"""
from __future__ import annotations

import argparse
import time

import maxjax  # noqa: F401  (sets the XLA defaults before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from maxjax.graphs import cpu_kernels, quant
from maxjax.models.quantize import pack_q4

LAYERS = 30
SHAPES = {   # name: (inputs, outputs, bits, calls a step)
    "qkv": (576, 960, 4, LAYERS), "o": (576, 576, 4, LAYERS), "gate_up": (576, 3072, 4, LAYERS),
    "down": (1536, 576, 4, LAYERS), "lm_head": (576, 49152, 8, 1),
}


def weight(rng, i: int, o: int, bits: int):
    if bits == 8:
        return cpu_kernels.pack_weight(quant.QuantizedWeight(
            jnp.asarray(rng.integers(-128, 128, (i, o)).astype(np.int8)),
            jnp.asarray(rng.uniform(1e-3, 2e-2, o).astype(np.float32))))
    return cpu_kernels.pack_weight(quant.QuantizedWeight(
        jnp.asarray(pack_q4(rng.integers(0, 16, (i, o)).astype(np.uint8))),
        jnp.asarray(rng.uniform(1e-3, 2e-2, (i // 32, o)), jnp.float32),
        jnp.asarray(rng.uniform(-0.1, 0.1, (i // 32, o)), jnp.float32), jnp.ones(o), bits=4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,16,32,64,256")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--layers", choices=("q4_1", "int8"), default="q4_1")
    ap.add_argument("--isa", choices=cpu_kernels.ISAS, default="avx512")
    args = ap.parse_args()
    why = cpu_kernels.unavailable(args.isa)
    name = cpu_kernels.EXTENSIONS[args.isa][0]
    if why or not cpu_kernels.set_extension(True, args.isa):
        raise SystemExit(f"needs the {args.isa} kernels and their extension here: "
                         f"{why or 'no ' + name}")
    rng = np.random.default_rng(0)
    f = jax.jit(lambda x, w: cpu_kernels.packed_linear(x, w, isa=args.isa))
    shapes = {name: (i, o, 8 if args.layers == "int8" else bits, calls)
              for name, (i, o, bits, calls) in SHAPES.items()}
    weights = {name: weight(rng, i, o, bits) for name, (i, o, bits, _) in shapes.items()}
    print(f"{args.isa}: without / with {name}")
    print(f"{'matrix':>8} {'rows':>5} {'without':>9} {'with':>9} {'speed-up':>9}")
    for rows in [int(r) for r in args.rows.split(",")]:
        step = {True: 0.0, False: 0.0}
        for name, (i, o, bits, calls) in shapes.items():
            x = jnp.asarray(rng.standard_normal((rows, i)).astype(np.float32))
            outs, times = {}, {True: [], False: []}
            for it in range(args.iters + 2):
                for on in ((True, False) if it % 2 else (False, True)):
                    cpu_kernels.set_extension(on, args.isa)
                    t = time.perf_counter()
                    y = f(x, weights[name]).block_until_ready()
                    if it >= 2:
                        times[on].append(time.perf_counter() - t)
                    outs[on] = y
            cpu_kernels.set_extension(True, args.isa)
            assert np.array_equal(np.asarray(outs[True]), np.asarray(outs[False])), name
            med = {on: float(np.median(t)) * 1e3 for on, t in times.items()}
            for on in step:
                step[on] += med[on] * calls
            print(f"{name:>8} {rows:>5} {med[False]:>9.3f} {med[True]:>9.3f} "
                  f"{med[False] / med[True]:>8.2f}x")
        print(f"{'a step':>8} {rows:>5} {step[False]:>9.2f} {step[True]:>9.2f} "
              f"{step[False] / step[True]:>8.2f}x")


if __name__ == "__main__":
    main()
