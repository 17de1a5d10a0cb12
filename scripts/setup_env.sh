#!/usr/bin/env bash
# Create (or reuse) a test environment: ${VENV:-.venv} with TRL ${TRL:-1.9.1} (the validated stack by default).
# BASE=<venv> copies an existing environment first (torch is 5.5 GB; copying beats reinstalling), as hard links where
# the filesystem allows (pip unlinks a file before writing it and writes its own records afresh, so the base stays
# intact): each further environment then costs only the packages that differ (about 1.5 GB, not 7).
# torch 2.14.1 + torchvision 0.29.1 are the validated stack's pins (where this project is developed they come from a
# local wheel cache, not the network); never ask for newer torch.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
trl_version=${TRL:-1.9.1}
transformers_version=${TRANSFORMERS:-5.17.0}
vllm_version=${VLLM:-0.25.1}
stamp="$venv/.stack-$trl_version-$transformers_version-$vllm_version-$(cat scripts/setup_env.sh pyproject.toml | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then echo "environment $venv ready (trl $trl_version)"; exit 0; fi
if [ ! -x "$venv/bin/python" ]; then
  if [ -n "${BASE:-}" ] && [ -x "$BASE/bin/python" ]; then
    rm -rf "$venv"  # a half-made folder would get the copy nested inside it
    if ! cp -al "$BASE" "$venv" 2>/dev/null; then
      echo "setup_env.sh: hard links refused here; copying $BASE in full (about 7 GB)" >&2
      rm -rf "$venv" && cp -a "$BASE" "$venv"
    fi
  else
    python3 -m venv "$venv"
  fi
fi
py="$venv/bin/python"
pip() { "$py" -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }
pip install "torch==2.14.1" "torchvision==0.29.1"
pip install "trl==$trl_version" "transformers==$transformers_version" requests accelerate datasets pillow peft jmespath \
  "wrapt>=1.14,!=2.2.0,<3" packaging pytest pytest-timeout pytest-xdist hypothesis ruff mypy
# vLLM without its heavy dependencies: enough to import LLM and CompilationConfig on the CPU (no engine runs here).
pip install --no-deps "vllm==$vllm_version"
pip install cbor2 pyzmq aiohttp openai openai-harmony cloudpickle msgspec pybase64 cachetools uvloop py-cpuinfo \
  prometheus_client llguidance xgrammar fastapi partial_json_parser pydantic
# ... and what its multimodal processor needs to build on the CPU (the engine stand-in runs vLLM's real processor)
pip install einops loguru blake3
pip install --no-deps "compressed-tensors==0.17.0"
pip install --no-deps --no-build-isolation -e . 2>/dev/null || pip install --no-deps -e .
rm -f "$venv"/.stack-*
touch "$stamp"
echo "environment $venv ready (trl $trl_version)"
