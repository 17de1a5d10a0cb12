#!/usr/bin/env bash
# Before a GPU record: the GPU scripts' dry runs on the CPU (tests/test_gpu_scripts.py: each script as the GPU
# machine runs it, one process per variant, with the engine stand-in at the tests' tiny shape), on the validated stack
# the record uses. Device time is scarce and a start is often refused: a script that fails here would fail there.
# About 4 minutes on 2 cores. CI leaves them out (scripts/test.sh; GPU_SCRIPTS=1 adds them there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pytest -n 3 -p no:cacheprovider -m gpu_scripts tests/test_gpu_scripts.py "$@"
