#!/usr/bin/env bash
# The whole test suite, setting up its own environments: ruff, mypy, the self-test, then pytest on the validated
# stack (trl 1.9.1) and on the newest TRL release (LATEST_TRL, 1.16.0 today). LATEST_TRL=none skips the second.
set -euo pipefail
cd "$(dirname "$0")/.."
latest=${LATEST_TRL:-1.16.0}
bash scripts/setup_env.sh
.venv/bin/ruff check trl_vlm_fixes tests examples benchmarks conftest.py
.venv/bin/mypy
.venv/bin/python -m trl_vlm_fixes selftest
.venv/bin/python -m pytest -n 2 "$@"
if [ "$latest" != "none" ]; then
  VENV=.venv-trl-latest TRL="$latest" BASE=.venv bash scripts/setup_env.sh
  .venv-trl-latest/bin/python -m trl_vlm_fixes selftest
  .venv-trl-latest/bin/python -m pytest -n 2 "$@"
fi
