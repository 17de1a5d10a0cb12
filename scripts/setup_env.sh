#!/usr/bin/env bash
# Create (or reuse) the test environment in ${VENV:-.venv}: the validated stack by default, or TRL=<version>.
# Facts from DEVELOPERS.md: torch 2.14.1 + torchvision 0.29.1 come from this machine's disk; never ask for newer torch.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
trl_version=${TRL:-1.9.1}
transformers_version=${TRANSFORMERS:-5.17.0}
vllm_version=${VLLM:-0.25.1}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
stamp="$venv/.stack-$trl_version-$transformers_version-$vllm_version-$(sha256sum scripts/setup_env.sh pyproject.toml | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then echo "environment $venv is ready (trl $trl_version)"; exit 0; fi
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
"$py" -m pip install -q "trl==$trl_version" "transformers==$transformers_version" requests accelerate datasets pillow \
  peft "wrapt>=1.14,!=2.2.0,<3" packaging pytest pytest-timeout hypothesis ruff mypy
# vLLM without its heavy dependencies: enough to import LLM and CompilationConfig on the CPU (no engine runs here).
"$py" -m pip install -q --no-deps "vllm==$vllm_version"
"$py" -m pip install -q cbor2 pyzmq aiohttp openai openai-harmony cloudpickle msgspec pybase64 cachetools uvloop \
  py-cpuinfo prometheus_client llguidance xgrammar fastapi partial_json_parser pydantic
"$py" -m pip install -q --no-deps -e .
rm -f "$venv"/.stack-*
touch "$stamp"
echo "environment $venv is ready (trl $trl_version)"
