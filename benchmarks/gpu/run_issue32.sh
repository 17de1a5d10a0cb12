#!/bin/bash
# Issue 32 on the GPU machine (H100/H200, Python 3.12, torch 2.11 cu130, no network): sampling_parity on the real
# engine (grpo_end_to_end.py, 1.2B) and a Qwen3.5 MoE VLM through colocate + sleep mode (moe_colocate.py). Writes the
# JSON records and full logs under $OUT (default /tmp/issue32-out). Run from the repo root.
#
#   bash benchmarks/gpu/run_issue32.sh prepare [DIR]   # HERE (CPU machine, registry access): bundles into DIR (.gpu)
#   bash benchmarks/gpu/run_issue32.sh sampling        # GPU: (a) sampling parity, fix on/off, default then qwen
#   bash benchmarks/gpu/run_issue32.sh moe [DIR/d]     # GPU: (b) installs vLLM's MoE kernels from DIR/d, then the MoE run
#   bash benchmarks/gpu/run_issue32.sh cost            # GPU: (c) sampling_parity's cost at 248,320 tokens, bf16
#   bash benchmarks/gpu/run_issue32.sh check           # GPU: versions, GPU, MoE kernels (a few seconds)
#
# ../shared does not travel to the GPU machine: `prepare` puts the bundles of ../shared/gpu/make_bundles.sh (a, b),
# its install_bundles.sh and bundle d (vLLM's MoE kernel library, vllm/_moe_C_stable_libtorch.abi3.so, which
# make_bundles.sh leaves out: without it no MoE layer runs) into DIR, ignored by git (/.gpu/ is). Each call carries at
# most 64 MiB, so one bundle per call. The device calls, chained at once (the machine goes back 30 s after a call):
#   1. run  bash .gpu/install_bundles.sh .gpu/a                 carry [.gpu/a, .gpu/install_bundles.sh]   ~1-2 min
#   2. run  bash .gpu/install_bundles.sh .gpu/b                 carry [.gpu/b, .gpu/install_bundles.sh]   ~1-2 min
#   3. run  bash benchmarks/gpu/run_issue32.sh sampling         timeout_s 600                             ~5-8 min
#   4. run  bash benchmarks/gpu/run_issue32.sh moe .gpu/d       carry [.gpu/d], timeout_s 600             ~5-8 min
# Expected times (from docs/gpu-results.md: a trainer + colocated engine start is 103-186 s at hidden 512, vLLM's
# 1.2B engine alone 130-147 s; a second process of the same model starts faster on vLLM's compile cache):
#   sampling: 1.2B model built on the CPU ~30-60 s, then 2 fresh processes (on, sampling_parity_off), each one engine
#             start ~130-200 s + 6 GRPO steps (3 default, 3 qwen) ~10-30 s; per-variant limit 260 s (worst case 580 s)
#   moe:      MoE kernels installed ~5 s, small MoE VLM built ~5 s, 2 fresh processes (on, reload_skip_off: the
#             contrast, stale experts after step 0), each ~110-200 s (start, fused-MoE Triton JIT) + 3 steps; limit 260 s
# Each script rewrites its JSON after every variant, so a call killed at its limit still returns the variants done.
# Dry run of this file on a CPU (stand-in engine, tiny model, 1 step per phase; a few minutes on 2 cores):
#   DRY_RUN=1 PY=.venv/bin/python bash benchmarks/gpu/run_issue32.sh sampling   (also: moe)
set -euo pipefail
part=${1:?usage: run_issue32.sh prepare [DIR] | sampling | moe [DIR/d] | cost | check}
OUT=${OUT:-/tmp/issue32-out}   # the device tool sets OUT; what is written there comes back
SITE=${SITE:-/root/site}
PY=${PY:-python3}
[ "$part" = prepare ] || mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -n "${DRY_RUN:-}" ]; then
  export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
  small=(--stand-in --tiny --steps 1 --max-completion-length 8)
  moe_small=(--stand-in --tiny --steps 2 --max-completion-length 8)
else
  # the checkout's plugin first (PLUGIN_PATH: a copy of it, e.g. one frozen for the call), then the bundles' vLLM 0.25.1 + TRL 1.9.1
  export PYTHONPATH=${PLUGIN_PATH:-.}:.:$SITE
  small=()
  moe_small=()
fi

check() {
  "$PY" - <<'EOF' 2>&1 | grep -v '^W[0-9]' | tee "$OUT/issue32-check.log"
import importlib, torch, transformers
versions = {"torch": torch.__version__, "transformers": transformers.__version__}
for name in ("vllm", "trl"):
    try:
        versions[name] = importlib.import_module(name).__version__
    except Exception as error:
        versions[name] = f"missing: {error!r}"
versions["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
try:
    import vllm._moe_C_stable_libtorch  # noqa: F401
    versions["moe_kernels"] = "importable"
except Exception as error:
    versions["moe_kernels"] = f"missing: {error!r}"
print(versions)
EOF
}

case "$part" in
  prepare)  # on the CPU machine with registry access, from the repo root
    dir=${2:-.gpu}
    mkdir -p "$dir"
    [ -f "$dir/a/C_stable.so.xz" ] && [ -f "$dir/b/vllm_rest.tar.xz" ] || bash ../shared/gpu/make_bundles.sh "$dir"
    cp ../shared/gpu/install_bundles.sh "$dir/install_bundles.sh"
    # d: vLLM 0.25.1's MoE kernels, from the same cp38-abi3 wheel as the bundles (the project's .venv holds it; the
    # sha256 of its core library is kept too, to check on the GPU machine that both come from one build)
    vllm_dir=$(${VENV_PY:-.venv/bin/python} -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("vllm").origin))')
    [ "$(${VENV_PY:-.venv/bin/python} -c 'from importlib.metadata import version; print(version("vllm"))')" = 0.25.1 ]
    mkdir -p "$dir/d"
    xz -T0 -9 -c "$vllm_dir/_moe_C_stable_libtorch.abi3.so" > "$dir/d/moe_C.so.xz"
    (cd "$vllm_dir" && sha256sum _moe_C_stable_libtorch.abi3.so _C_stable_libtorch.abi3.so) > "$dir/d/sha256"
    du -sh "$dir"/a "$dir"/b "$dir"/d
    ;;
  check)
    check
    ;;
  sampling)  # (a): GRPO on the 1.2B script, fix on and off, 3 steps default sampling then 3 steps top_p 0.95 top_k 20
    check
    "$PY" benchmarks/gpu/grpo_end_to_end.py --hidden 2048 --layers 16 --variants "${SAMPLING_VARIANTS:-on,sampling_parity_off}" \
      --sampling default,qwen --steps 3 --timeout ${VARIANT_TIMEOUT:-260} --out "$OUT/issue32-sampling.json" "${small[@]}" 2>&1 \
      | tee "$OUT/issue32-sampling.log"
    ;;
  moe)  # (b): the MoE kernels first (the bundles lack them), then the MoE VLM through colocate + sleep mode
    if [ -z "${DRY_RUN:-}" ] && [ ! -f "$SITE/vllm/_moe_C_stable_libtorch.abi3.so" ]; then
      bundle=$(cd "${2:-.gpu/d}" && pwd)
      xz -dc -T0 "$bundle/moe_C.so.xz" > "$SITE/vllm/_moe_C_stable_libtorch.abi3.so"
      # both lines must say OK: the kernels unpacked intact, and the bundles' vLLM core is the same build as theirs
      (cd "$SITE/vllm" && sha256sum -c "$bundle/sha256") \
        || echo "WARNING: vLLM's MoE kernels or core library differ from the bundle's build (see above)"
    fi
    check
    "$PY" benchmarks/gpu/moe_colocate.py --family qwen3_5_moe --hidden 512 --layers 4 --experts 8 \
      --experts-per-token 2 --moe-intermediate 384 --steps 3 --variants "${MOE_VARIANTS:-on,reload_skip_off}" --timeout ${VARIANT_TIMEOUT:-260} \
      --out "$OUT/issue32-moe.json" "${moe_small[@]}" 2>&1 | tee "$OUT/issue32-moe.log"
    ;;
  cost)  # (c): sampling_parity's scoring cost at Qwen3.5's vocabulary (248,320) on the GPU, 2B- and 9B-class shapes
    check
    # 2B- and 9B-class shapes with the fix's chunks (2^26 logits), then the 9B shape with the earlier 2^24
    for shape in "--hidden 2048 --layers 24" "--hidden 4096 --layers 32" "--hidden 4096 --layers 32 --chunk-elements 16777216"; do
      # shellcheck disable=SC2086  # the shape is two options
      "$PY" benchmarks/sampling_parity_cost.py $shape --rows 4 --prompt 512 --completion 512 --device cuda \
        --dtype bfloat16 2>&1 | grep -v "falling back" | tee -a "$OUT/issue32-cost.log" || echo "cost $shape: failed"
    done
    ;;
  *)
    echo "unknown part $part: prepare [DIR] | sampling | moe [DIR/d] | cost | check" >&2
    exit 2
    ;;
esac
