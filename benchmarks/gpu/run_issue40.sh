#!/bin/bash
# Issue 40 on the GPU machine (H100/H200, Python 3.12, torch 2.11 cu130, vLLM 0.25.1 + TRL 1.9.1 under $SITE, no
# network): the GPU records of this wave. Writes the JSON records and full logs under $OUT (default /tmp/issue40-out).
# Run from the repo root, after the bundles of run_issue32.sh are installed (its steps 1-2).
#
#   bash benchmarks/gpu/run_issue40.sh sampling   # sampling parity on the real engine's GPU path (~7-8 min)
#   bash benchmarks/gpu/run_issue40.sh tensors    # every tensor after every push (every_tensor.py, ~3 min, no MoE)
#   bash benchmarks/gpu/run_issue40.sh check      # versions, GPU (a few seconds)
# ENGINE_EAGER=1 builds the engines with enforce_eager=True (no torch.compile, no graph capture: seconds instead of
# ~2 minutes per engine start; the sampler path, the subject of `sampling`, is the same: sampling runs outside graphs).
#
# sampling: a 2B-class random Qwen3.5 VLM (hidden 2048, 24 layers, vocabulary 248,320, bf16) whose output layer is
# scaled by LOGIT_SCALE (default 5: logits of std ~4.5 instead of ~0.9, a mean next-token entropy of a few nats as a
# trained model's instead of ~12; each variant records the entropy it measured, `entropy_nats`), GRPO colocated with
# 8 requests per engine step (4 prompts x 2 generations: vLLM's Triton top-k/top-p kernel; the plugin sends the steps
# of fewer requests, as sequences finish, to the same kernel), 3 steps of default sampling then 3 of top_p=0.95,
# top_k=20, the fix on and off (fresh process each: one engine start with vLLM's compile, ~130-200 s, + 6 steps).
# Per step: TRL's mean IS weight, sampling_logp_difference, the kept share; with the fix the per-token gap under
# truncation over the gap without (`sampling_parity.qwen.gap_over_default_on`: ~1 when only the engine/trainer
# mismatch is left). SAMPLING_VARIANTS=on,sampling_parity_off by default; PLUGIN_PATH=<a frozen copy of the plugin,
# e.g. git HEAD before this wave> runs that copy instead of the checkout (a third call, same command).
# Dry run on a CPU (stand-in engine, tiny model, 1 step per phase; a few minutes on 2 cores):
#   DRY_RUN=1 PY=.venv/bin/python bash benchmarks/gpu/run_issue40.sh sampling
set -euo pipefail
part=${1:?usage: run_issue40.sh sampling | tensors | check}
OUT=${OUT:-/tmp/issue40-out}   # the device tool sets OUT; what is written there comes back
SITE=${SITE:-/root/site}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -n "${DRY_RUN:-}" ]; then
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
  small=(--stand-in --tiny --steps 1 --max-completion-length 8)
  tensors=(--stand-in --tiny)
else
  export PYTHONPATH=${PLUGIN_PATH:-.}:.:$SITE
  small=(--steps 3 --max-completion-length 64)
  read -r -a tensors <<<"${TENSOR_ARGS:---no-moe}"  # MoE families need vLLM's MoE kernels (bundle d)
fi

check() {
  "$PY" - <<'PYEOF' 2>&1 | grep -v '^W[0-9]' | tee "$OUT/issue40-check.log"
import importlib, torch, transformers
versions = {"torch": torch.__version__, "transformers": transformers.__version__}
for name in ("vllm", "trl", "trl_vlm_fixes"):
    try:
        module = importlib.import_module(name)
        versions[name] = getattr(module, "__version__", module.__file__)
    except Exception as error:
        versions[name] = f"missing: {error!r}"
versions["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(versions)
PYEOF
}

case "$part" in
  check)
    check
    ;;
  sampling)
    check
    "$PY" benchmarks/gpu/grpo_end_to_end.py --hidden 2048 --layers 24 --logit-scale "${LOGIT_SCALE:-5}" \
      --variants "${SAMPLING_VARIANTS:-on,sampling_parity_off}" --sampling default,qwen \
      --timeout "${VARIANT_TIMEOUT:-280}" --out "$OUT/issue40-sampling.json" "${small[@]}" 2>&1 \
      | tee "$OUT/issue40-sampling.log"
    ;;
  tensors)
    check
    "$PY" benchmarks/gpu/every_tensor.py "${tensors[@]}" --out "$OUT/issue40-every-tensor.json" 2>&1 \
      | tee "$OUT/issue40-every-tensor.log"
    ;;
  *)
    echo "unknown part $part: sampling | tensors | check" >&2
    exit 2
    ;;
esac
