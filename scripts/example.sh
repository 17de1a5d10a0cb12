#!/usr/bin/env bash
# Set up .venv if needed, then run the example: GRPO on a tiny Qwen3.5 VLM with a mixed image batch (CPU, < 1 min).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python examples/grpo_qwen35_vlm.py "$@"
