#!/usr/bin/env bash
# The CUDA measurements that the README quotes, in parts short enough that several fit in
# one sitting on a GPU machine:
#
#   scripts/cuda_suite.sh RESULTS_DIR PART [PART ...]
#
# Parts, in the order they are worth running:
#   tests        the attention, layer and dense-linear Triton tests compiled, the engine on
#                them, and every test marked `gpu`
#   qtests       the quantized and LoRA Triton tests compiled (many shapes: slow to compile)
#   quantized    W4A16 GEMV and tensor-core kernels, and the dense split-K kernel, against
#                cuBLAS, 1-32 rows
#   kernels      paged decode attention against its KV floor: 4 and 8 warps a program, and
#                the unsplit varlen kernel of mixed-step graphs, up to 32k-token contexts
#   latency      llama3-8b batch-1 TPOT against its floor, async scheduling off and on, and
#                with every linear layer on cuBLAS (no split-K kernel)
#   latency4     the same on its 4-bit RTN copy
#   step         decode steps against their roofline, with a kernel profile, steps with
#                prefill chunks replayed from CUDA graphs against eager, and the JSON that
#                `kvserve simulate` fits its cost model to; then a profile of a step with a
#                prefill chunk
#   throughput   the fixed offline workload against transformers (eager and compiled)
#   nano         nano-vllm's workload on qwen3-0.6b, async scheduling off and on
#   preemption   swap against recompute on a pool too small for the batch
#   speculative  prompt-lookup drafts at batch 1
#   lora         8 adapters in one batch against the base model
#   structured   JSON-schema output against free output of the same tokens (needs
#                llguidance and jsonschema importable)
#   moe          mixture-of-experts models against transformers on CUDA, and
#                qwen3-moe-small's batch-1 TPOT against its floor and transformers
#   serve        llama3-8b's server under Poisson load, prompts of 1-4k tokens, chunked
#                prefill against prefill-first (needs fastapi, uvicorn and pydantic
#                importable)
#
# Each part runs under its own limit (seconds: LIMIT_<part>, e.g. LIMIT_tests=300), logs to
# RESULTS_DIR/<part>.log and writes its JSON beside it; a part that fails or runs out of time
# is reported, the next one runs, and the script exits with 1 at the end. Checkpoints are
# made once, in MODELS (default /tmp/kvserve-suite), and reused by later parts and calls;
# they are made in the background while the parts that need none (`tests`, `qtests`,
# `quantized`, `kernels`) run.
#
# It runs from a source checkout with no install (PYTHONPATH=src). DEVICE=cpu SMALL=1 runs
# every part on small presets on the CPU: a check of the commands, not a measurement.
set -uo pipefail

if [ $# -lt 2 ]; then
  sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
PARTS=(tests qtests quantized kernels latency latency4 step throughput nano preemption speculative
       lora structured moe serve)
declare -A DEFAULT_LIMIT=([tests]=200 [qtests]=300 [quantized]=180 [kernels]=90 [latency]=330
                          [latency4]=240 [step]=200 [throughput]=300 [nano]=240 [preemption]=180
                          [speculative]=180 [lora]=180 [structured]=180 [moe]=180
                          [serve]=300)
SELF=$(realpath "$0")
RESULTS=$(realpath -m "$1")
shift
for part in "$@"; do
  if [ "$part" != --one ] && [ -z "${DEFAULT_LIMIT[$part]:-}" ]; then
    echo "unknown part '$part': one of ${PARTS[*]}" >&2
    exit 2
  fi
done
cd "$(dirname "$SELF")/.."
mkdir -p "$RESULTS"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
MODELS=${MODELS:-/tmp/kvserve-suite}
if [ "${SMALL:-0}" = 1 ]; then
  BIG=small QWEN=small QWEN_ARCH=(--arch qwen3) PROMPTS=8 HF_BATCH=8 RATES=(1 2)
  SERVE_PROMPTS=(--prompt-min 128 --prompt-max 512)
else
  BIG=llama3-8b QWEN=qwen3-0.6b QWEN_ARCH=() PROMPTS=64 HF_BATCH=64 RATES=(2 4 8)
  # Prompts longer than the 512-token budget, which chunked prefill splits and prefill-first
  # runs whole: with prompts that fit the budget the two schedules run the same steps.
  SERVE_PROMPTS=(--prompt-min 1024 --prompt-max 4096 --output-min 64 --output-max 256)
fi

kvserve() { "$PYTHON" -m kvserve "$@"; }

# The folder of a checkpoint made from PRESET (extra make-model flags after it), made once;
# where that fails, the benchmark given the folder says so.
model() {
  local dir
  dir=$MODELS/$(echo "$*" | tr -d '-' | tr ' ' '_')
  [ -f "$dir/config.json" ] || kvserve make-model "$@" --dtype bfloat16 --output "$dir" >&2
  echo "$dir"
}

quantized_model() {
  local dir=$MODELS/$BIG-rtn4
  [ -f "$dir/config.json" ] || kvserve quantize "$(model "$BIG")" --method rtn --bits 4 \
    --output "$dir" >&2
  echo "$dir"
}

# The whole engine against transformers first, then the kernels, attention first: what a
# short limit leaves out is what the others cover in part.
part_tests() {
  local status=0
  "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/models/test_hf_equivalence.py \
    tests/models/test_async_scheduling.py tests/unit/test_bench_device.py \
    tests/unit/test_engine_args.py || status=1
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
    tests/kernels/test_triton_engine.py tests/kernels/test_triton_layers.py \
    tests/kernels/test_triton_linear.py || status=1
  return $status
}

part_qtests() {
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_quantized.py \
    tests/kernels/test_triton_lora.py
}

part_quantized() {
  kvserve bench quantized --device "$DEVICE" --batches 1 2 4 8 16 32 \
    --json "$RESULTS/quantized.json"
}

part_kernels() {
  kvserve bench kernels --device "$DEVICE" --json "$RESULTS/kernels.json"
  kvserve bench kernels --device "$DEVICE" --contexts 16384 32768 --batches 1 4 \
    --json "$RESULTS/kernels-long.json"
}

part_latency() {
  for async in --no-async-scheduling --async-scheduling; do
    kvserve bench latency --model "$(model "$BIG")" --device "$DEVICE" --baseline none --runs 3 \
      --output-len 128 $async --json "$RESULTS/latency-${async#--}.json"
  done
  KVSERVE_DENSE_KERNEL=cublas kvserve bench latency --model "$(model "$BIG")" \
    --device "$DEVICE" --baseline none --runs 3 --output-len 128 --async-scheduling \
    --json "$RESULTS/latency-cublas.json"
}

part_latency4() {
  kvserve bench latency --model "$(quantized_model)" --device "$DEVICE" --baseline none --runs 3 \
    --output-len 128 --json "$RESULTS/latency4.json"
}

part_step() {
  kvserve bench step --model "$(model "$BIG")" --device "$DEVICE" --max-num-seqs 264 \
    --decodes 1 8 32 64 128 256 \
    --chunks 64 256 512 --context 1024 --profile 10 --json "$RESULTS/step.json"
  kvserve bench step --model "$(model "$BIG")" --device "$DEVICE" --decodes 1 --chunks 256 \
    --context 1024 --profile 5 --profile-chunk 256
}

part_throughput() {
  kvserve bench throughput --model "$(model "$BIG")" --device "$DEVICE" --workloads a \
    --num-prompts "$PROMPTS" --hf-batch-sizes "$HF_BATCH" --baseline hf --hf-compile \
    --json "$RESULTS/throughput.json"
}

part_nano() {
  for async in --no-async-scheduling --async-scheduling; do
    kvserve bench throughput --model "$(model "$QWEN" "${QWEN_ARCH[@]}")" --device "$DEVICE" --workloads nano \
      --baseline none $async --json "$RESULTS/nano-${async#--}.json"
  done
}

part_preemption() {
  kvserve bench preemption --model "$(model "$QWEN" "${QWEN_ARCH[@]}")" --device "$DEVICE" \
    --json "$RESULTS/preemption.json"
}

part_speculative() {
  kvserve bench speculative --model "$(model "$BIG")" --device "$DEVICE" \
    --speculative-model ngram --json "$RESULTS/speculative.json"
}

part_serve() {
  "$PYTHON" -c 'import fastapi, uvicorn, pydantic' || {
    echo "serve needs fastapi, uvicorn and pydantic in $PYTHON" >&2
    return 1
  }
  kvserve bench serve --model "$(model "$BIG")" --device "$DEVICE" \
    --max-num-batched-tokens 512 --rates "${RATES[@]}" --num-prompts "$PROMPTS" \
    "${SERVE_PROMPTS[@]}" --json "$RESULTS/serve.json"
}

part_lora() {
  kvserve bench lora --model "$(model "$BIG")" --device "$DEVICE" --num-adapters 8 \
    --json "$RESULTS/lora.json"
}

part_structured() {
  kvserve bench structured --model "$(model "$BIG")" --device "$DEVICE" \
    --num-prompts "$PROMPTS" --json "$RESULTS/structured.json"
}

part_moe() {
  "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/models/test_moe.py
  kvserve bench latency --model "$(model qwen3-moe-small)" --device "$DEVICE" --runs 3 \
    --output-len 128 --json "$RESULTS/moe.json"
}

if [ "$1" = --one ]; then  # one part, run by the loop below under its limit
  set -e
  "part_$2"
  exit
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  "$PYTHON" -c 'import torch; print("torch", torch.__version__)'; } | tee "$RESULTS/machine.txt"
# The checkpoints the parts need are made in the background from the start, so that the
# parts that need none (tests, quantized, kernels) run meanwhile; a part that needs one waits.
make_checkpoints() {
  for part in "$@"; do
    case $part in
      tests|qtests|quantized|kernels) ;;
      nano|preemption) model "$QWEN" "${QWEN_ARCH[@]}" > /dev/null ;;
      moe) model qwen3-moe-small > /dev/null ;;
      latency4) quantized_model > /dev/null ;;
      *) model "$BIG" > /dev/null ;;
    esac
  done
}
make_checkpoints "$@" > "$RESULTS/checkpoints.log" 2>&1 &
maker=$!
failed=0
for part in "$@"; do
  if [ -n "$maker" ] && [[ ! "$part" =~ ^(tests|qtests|quantized|kernels)$ ]]; then
    wait "$maker"
    maker=
  fi
  limit_var=LIMIT_$part
  limit=${!limit_var:-${DEFAULT_LIMIT[$part]}}
  start=$SECONDS
  timeout --kill-after=10 "$limit" "$SELF" "$RESULTS" --one "$part" > "$RESULTS/$part.log" 2>&1
  status=$?
  case $status in
    0) verdict=ok ;;
    124|137) verdict="out of time (limit $limit s)" ;;
    *) verdict="failed (exit $status)" ;;
  esac
  [ $status = 0 ] || failed=1
  echo "== $part: $verdict in $((SECONDS - start)) s" | tee -a "$RESULTS/summary.txt"
  grep -E '^\||passed|failed|rror' "$RESULTS/$part.log" | tail -40
done
exit $failed
