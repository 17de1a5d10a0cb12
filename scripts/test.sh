#!/usr/bin/env bash
# The whole test suite, setting up its own environments: ruff, mypy, the wheel (built, installed into a fresh virtual
# environment, `trl-vlm-fixes status` from there), then pytest against the installed wheel (not the checkout; its
# test_selftest.py runs the installed self-test) on two stacks: the validated one (trl 1.9.1, transformers 5.17.0,
# vllm 0.25.1), and the newest TRL release (LATEST_TRL, 1.16.0 today) with the transformers and vLLM its users run
# (NEWEST_TRANSFORMERS 5.25.0, NEWEST_VLLM 0.31.0, the newest TRL 1.16 supports). LATEST_TRL=none runs the validated
# stack only. LATEST_TRL_ON_VALIDATED=1 adds, between the two, that TRL on the validated transformers and vLLM (not in
# CI: it tells a TRL change from a transformers/vLLM one, and three stacks do not fit CI's 30 minutes on 2 cores; last
# run 2026-12-05 on commit 5620319, every test passed). Extra arguments go to pytest. Each stage prints its time
# ("stage ... took N s"), pytest its 25 slowest tests (--durations), and the end the whole run's time against CI's
# budget (TEST_BUDGET_S, 1800 s: 30 minutes on CI's 2 cores; a WARNING line when over, not a failure: these machines
# are noisy, and the exit status stays the run's own).
#
# pytest runs 3 workers on CI's 2 cores: many tests wait on subprocesses, timers and hang limits rather than compute
# (conftest.py gives every test process one OpenMP thread, so the workers do not spin against each other).
# Tests marked `stack_independent` run on the validated stack only: what they prove cannot differ between the stacks
# (the plugin's own mechanisms, which import no TRL/transformers/vLLM code on the path they test: the watchdog's timer,
# backstop, report and limits files, the resume decision over checkpoint folders; the launcher's bootstrap). The GPU
# scripts' dry runs (marked `gpu_scripts`) are left out: they check the benchmark scripts, and run before each GPU
# record (scripts/gpu_preflight.sh; GPU_SCRIPTS=1 adds them here). Every other
# test that runs TRL, transformers or vLLM code runs on both. Also marked, by the same rule: the plugin's switch parsing
# and version comparison at its import, its metric counters (on torch tensors: torch is 2.14.1 on every stack),
# ARCHITECTURE.md's worked example against the plugin's source, the layering of the plugin's own imports
# (tests/test_layering.py), the self-test's `--only` validation and its message with TRL hidden. A test moved to one
# stack, one variant or the unit level says in a comment where the coverage it had now lives: so do the long
# multi-process protection, resume and watchdog runs kept on the validated stack for CI's time (tests/test_resume.py,
# tests/test_watchdog.py), each naming the test that runs TRL's path on the newest stack.
#
# --dist worksteal: a worker that runs out of tests takes queued ones from the others, so one worker is not left with
# a queue of slow end-to-end tests while the rest idle at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
budget=${TEST_BUDGET_S:-1800}
report_total() {  # on every exit, success or failure: the whole run's time against the budget; the status is kept
  local status=$? total=$((SECONDS - started))
  # a failure before a background job was waited for (ruff/mypy, the newest stack's environment): none outlives the run
  jobs -p | xargs -r kill 2>/dev/null || true
  echo "scripts/test.sh: whole run took $total s ($((total / 60)) min $((total % 60)) s; budget $budget s)" >&2
  if [ "$total" -gt "$budget" ]; then
    echo "scripts/test.sh: WARNING: the run took $total s, over the $budget s budget (a warning, not a failure:" \
      "see the stage times and pytest's slowest tests above)" >&2
  fi
  exit "$status"
}
latest=${LATEST_TRL:-1.16.0}
newest_transformers=${NEWEST_TRANSFORMERS:-5.25.0}
newest_vllm=${NEWEST_VLLM:-0.31.0}
if [ "$newest_vllm" = none ] || [ "$newest_transformers" = none ]; then  # NEWEST_VLLM=none once skipped the third stack
  echo "scripts/test.sh: the newest stack is the only one after the validated stack; LATEST_TRL=none skips it." >&2
  exit 2
fi
started=$SECONDS
stage_started=$SECONDS
trap report_total EXIT
stage() {  # the time of the stage that just ended, then the name of the next
  echo "scripts/test.sh: stage ${current:-setup} took $((SECONDS - stage_started)) s (total $((SECONDS - started)) s)" >&2
  current=$1
  stage_started=$SECONDS
}

# Enough disk for the environments still to build? (Measured: the first takes about 7 GB, torch alone 5.5; each further
# one, hard-linked to it, about 1.5.) Say so at once rather than die in pip with "No space left on device".
need_gb=0
[ -x .venv/bin/python ] || need_gb=8
if [ "$latest" != "none" ]; then
  [ -x .venv-newest/bin/python ] || need_gb=$((need_gb + 2))
  [ "${LATEST_TRL_ON_VALIDATED:-0}" != 1 ] || [ -x .venv-trl-latest/bin/python ] || need_gb=$((need_gb + 2))
fi
free_gb=$(($(df -Pk . | awk 'NR==2 {print $4}') / 1048576))
if [ "$free_gb" -lt "$need_gb" ]; then
  echo "scripts/test.sh: only $free_gb GB free under $root; the test environments still to build need about $need_gb GB." >&2
  echo "Free disk space (old clones, old .venv-* folders, pip's cache), or test the validated stack only: LATEST_TRL=none." >&2
  exit 1
fi
current="environment (validated stack)"
bash scripts/setup_env.sh
stage "wheel"
# ruff and mypy (about 40 s, one core) run while the wheel is built and the validated stack's tests start; their
# verdict is read right after those tests (a failure fails the run there, its output printed)
lint_log=$(mktemp)
(.venv/bin/ruff check trl_vlm_fixes tests examples benchmarks conftest.py \
  && .venv/bin/ruff format --check trl_vlm_fixes tests examples benchmarks conftest.py && .venv/bin/mypy) >"$lint_log" 2>&1 &
lint=$!

# the package as users get it: a wheel (built afresh: a stale build/ would carry deleted modules), installed into a
# fresh environment, its console script answering
rm -rf build dist && .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w dist . >/dev/null
wheel=$(ls dist/trl_vlm_fixes-*.whl)
rm -rf .venv-wheel-check && python3 -m venv .venv-wheel-check
.venv-wheel-check/bin/python -m pip install -q --disable-pip-version-check "$wheel"
(cd /tmp && "$root/.venv-wheel-check/bin/trl-vlm-fixes" status && "$root/.venv-wheel-check/bin/trl-vlm-fixes" status --json \
  | "$root/.venv-wheel-check/bin/python" -c "import json,sys; from trl_vlm_fixes.patches import ALL_FIXES as f; r=json.load(sys.stdin); assert r['activation']=='import' and list(r['patches'])==[x.name for x in f], r")

# tests run from a folder without the package in it, so `import trl_vlm_fixes` is the installed wheel
stage=$root/.test-stage
rm -rf "$stage" && mkdir -p "$stage"
for item in tests benchmarks examples conftest.py pyproject.toml README.md ARCHITECTURE.md CHANGELOG.md docs; do ln -s "$root/$item" "$stage/$item"; done
run_suite() {  # $1: the virtual environment, $2: the pytest marker expression; the rest go to pytest
  "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
  (cd "$stage" && "$1/bin/python" -c "import trl_vlm_fixes, sys; sys.exit(trl_vlm_fixes.__file__.startswith('$root/trl_vlm_fixes'))")
  stage "pytest ($1, -m '$2')"
  # exit 5 (no test selected) fails the run like any other non-zero status (set -e): a marker expression that
  # selects nothing is a broken run, never a green one
  (cd "$stage" && "$1/bin/python" -m pytest -n 3 --dist worksteal -p no:cacheprovider --durations=25 -m "$2" "${@:3}")
}
await_background() {  # $1: a background job's pid, $2: its log (printed, removed), $3: what it did; fails the run
  local status=0
  wait "$1" || status=$?
  cat "$2" >&2
  rm -f "$2"
  [ "$status" = 0 ] || { echo "scripts/test.sh: $3 failed ($status)" >&2; exit 1; }
}
# the newest stack's environment is built while the validated stack's tests run (pip waits on the disk and the
# registry, the tests mostly on subprocesses): its log is printed when it is needed
newest_setup=""
if [ "$latest" != "none" ]; then
  # the hard-linked copy first, in the foreground: the validated stack's wheel install below must not change .venv
  # while it is being copied (pip then unlinks before it writes, so neither environment changes the other)
  [ -x .venv-newest/bin/python ] || cp -al .venv .venv-newest 2>/dev/null || rm -rf .venv-newest
  newest_log=$(mktemp)
  (VENV=.venv-newest TRL="$latest" TRANSFORMERS="$newest_transformers" VLLM="$newest_vllm" BASE=.venv \
    bash scripts/setup_env.sh >"$newest_log" 2>&1) &
  newest_setup=$!
fi
stage "install (validated stack)"
# the GPU scripts' dry runs run before a GPU record (scripts/gpu_preflight.sh), not here; GPU_SCRIPTS=1 adds them
if [ "${GPU_SCRIPTS:-0}" = 1 ]; then validated_marks=""; else validated_marks="not gpu_scripts"; fi
run_suite "$root/.venv" "$validated_marks" "$@"
stage "ruff and mypy (run beside the tests above)"
await_background "$lint" "$lint_log" "ruff or mypy"
if [ "$latest" != "none" ]; then
  if [ "${LATEST_TRL_ON_VALIDATED:-0}" = 1 ]; then
    stage "environment (TRL $latest)"
    VENV=.venv-trl-latest TRL="$latest" BASE=.venv bash scripts/setup_env.sh
    run_suite "$root/.venv-trl-latest" "not stack_independent" "$@"
  fi
  stage "environment (TRL $latest, transformers $newest_transformers, vLLM $newest_vllm)"
  await_background "$newest_setup" "$newest_log" "the newest stack's environment"
  run_suite "$root/.venv-newest" "not stack_independent" "$@"
fi
stage done
