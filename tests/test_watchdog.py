"""watchdog: a vLLM generate that never returns ends the process with exit 75 and a report; off, nothing runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import environment_without_switches, run_python

PROGRAMS = Path(__file__).parent / "programs"


def run_hang_program(tiny_model_dir: Path, tmp_path: Path, env: dict[str, str], timeout: float) -> Any:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(PROGRAMS / "hang_generate.py"), str(tiny_model_dir), str(tmp_path)],
        env={**environment_without_switches(), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result, time.monotonic() - started


@pytest.mark.slow
def test_a_generate_that_never_returns_ends_the_process_with_75(tiny_model_dir: Path, tmp_path: Path) -> None:
    limit = 5
    result, _ = run_hang_program(tiny_model_dir, tmp_path, {"TRL_VLM_FIXES_WATCHDOG": str(limit)}, 240)
    assert result.returncode == 75, result.stderr[-3000:]
    report = (tmp_path / "trl_vlm_fixes_hang_rank0.txt").read_text()
    assert "VLLMGeneration.generate" in report and "at step 0" in report
    assert "gdn_prefill_backend=triton" in report and "resume_from_checkpoint" in report
    assert "ran longer than 5 s" in result.stderr and "resume_from_checkpoint" in result.stderr
    hang_to_exit = time.time() - float((tmp_path / "hang_started").read_text())
    assert limit <= hang_to_exit <= limit + 15, hang_to_exit


@pytest.mark.slow
def test_without_the_watchdog_the_hang_goes_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_hang_program(tiny_model_dir, tmp_path, {"TRL_VLM_FIXES_WATCHDOG": "0"}, 60)
    assert not (tmp_path / "trl_vlm_fixes_hang_rank0.txt").exists()


@pytest.mark.slow
def test_a_normal_run_never_fires(tiny_model_dir: Path, tmp_path: Path) -> None:
    result, _ = run_hang_program(tiny_model_dir, tmp_path, {"TRL_VLM_FIXES_WATCHDOG": "20", "HANG_RANK": "-1"}, 300)
    assert result.returncode == 0 and "trained 2" in result.stdout, result.stderr[-3000:]
    assert not list(tmp_path.glob("trl_vlm_fixes_hang_rank*.txt"))


@pytest.mark.slow
def test_a_hang_on_one_rank_ends_both_under_accelerate(tiny_model_dir: Path, tmp_path: Path) -> None:
    from conftest import free_port

    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", free_port(), str(PROGRAMS / "hang_generate.py"), str(tiny_model_dir),
               str(tmp_path)]
    env = {**environment_without_switches(), "TRL_VLM_FIXES_WATCHDOG": "5", "HANG_RANK": "1", "ACCELERATE_USE_CPU": "1"}
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode != 0, result.stderr[-3000:]
    assert (tmp_path / "trl_vlm_fixes_hang_rank1.txt").exists()
    assert "exitcode  : 75" in result.stderr or "exit code 75" in result.stderr, result.stderr[-3000:]
    assert time.monotonic() - started < 280


@pytest.mark.parametrize("value", ["soon", "-5", "inf"])
def test_bad_watchdog_value_fails_the_import(value: str) -> None:
    result = run_python("import trl_vlm_fixes", env={"TRL_VLM_FIXES_WATCHDOG": value})
    assert result.returncode != 0 and f"TRL_VLM_FIXES_WATCHDOG={value!r}" in result.stderr
    assert "0 to turn the rollout watchdog off" in result.stderr


def test_watchdog_off_means_no_thread_and_no_wrapper() -> None:
    result = run_python(
        """
        import threading
        import trl_vlm_fixes, trl.generation.vllm_generation as vg
        print(json.dumps({"state": trl_vlm_fixes.status()["patches"]["watchdog"]["state"],
                          "threads": [t.name for t in threading.enumerate()]}))
        """,
        env={"TRL_VLM_FIXES_WATCHDOG": "0"},
    )

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["state"] == "disabled" and "trl_vlm_fixes-watchdog" not in report["threads"]


def test_arm_and_disarm_leave_nothing_armed() -> None:
    from trl_vlm_fixes.patches.watchdog.timer import Watchdog

    dog = Watchdog()
    fired: list[int] = []
    tokens = [dog.arm(60, lambda: fired.append(1)) for _ in range(100)]  # type: ignore[arg-type, func-returns-value]
    for token in tokens:
        dog.disarm(token)
    assert dog._armed == {} and not fired
    assert any(t.name == "trl_vlm_fixes-watchdog" for t in threading.enumerate())
