#!/bin/bash
# The GPU record of sampling_parity's float32 log-probs (H100/H200, vLLM 0.25.1 + TRL 1.9.1 installed under $SITE from
# ../shared/gpu's bundles, no network). Writes logs and JSON under $OUT. Run from the repo root, after the bundles:
#   1. run  bash .gpu/install_bundles.sh .gpu/bundles/a      carry [.gpu/bundles/a, .gpu/install_bundles.sh]
#   2. run  bash .gpu/install_bundles.sh .gpu/bundles/b && bash benchmarks/gpu/run_float32_record.sh sampling
#                                                           carry [.gpu/bundles/b, .gpu/install_bundles.sh]
#   3. run  bash benchmarks/gpu/run_float32_record.sh cost  (same warm machine)
# sampling: run_issue40.sh's sampling record (2B-class Qwen3.5 VLM, bf16, 8 requests per step, default sampling then
#           top_p=0.95/top_k=20, the fix on and off), engines eager (the sampler path is the same; starts in seconds).
# cost:     sampling_parity_cost.py at the 2B-class shape in bf16, Qwen3.5's vocabulary and Qwen3-VL's, completions
#           of 512 and 1,024 tokens (4 per scoring chunk): the fix's share of the scoring pass per setting, "nothing
#           cut" included (the float32 log-softmax pass over TRL 1.9.1's bf16 logits).
set -uo pipefail
part=${1:?usage: run_float32_record.sh sampling | cost}
OUT=${OUT:-/tmp/float32-out}
SITE=${SITE:-/root/site}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:$SITE
case "$part" in
  sampling)
    ENGINE_EAGER=1 VARIANT_TIMEOUT=${VARIANT_TIMEOUT:-220} OUT=$OUT bash benchmarks/gpu/run_issue40.sh sampling
    ;;
  cost)
    for shape in "--vocabulary 248320 --completion 512" "--vocabulary 248320 --completion 1024" \
      "--vocabulary 151936 --completion 1024"; do
      # shellcheck disable=SC2086  # the shape is several options
      timeout "${COST_TIMEOUT:-170}" "$PY" benchmarks/sampling_parity_cost.py --hidden 2048 --layers 24 --rows 4 \
        --prompt 256 $shape --device cuda --dtype bfloat16 2>&1 | grep -v "falling back" | tee -a "$OUT/float32-cost.log" \
        || echo "cost $shape: failed or timed out" | tee -a "$OUT/float32-cost.log"
    done
    ;;
  *)
    echo "unknown part $part: sampling | cost" >&2
    exit 2
    ;;
esac
