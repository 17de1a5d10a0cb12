"""Engine fixes only for Gated-DeltaNet models (cudagraph, gdn_prefill), the visible log lines, and the watchdog."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from subprocess_helpers import environment_without_switches, run_python

import trl_vlm_fixes
from trl_vlm_fixes.patches.gdn_prefill import VALID_BACKENDS

PROGRAMS = Path(__file__).parent / "programs"


def test_gdn_model_engine_gets_triton_prefill_and_no_graphs(make_generation: Any) -> None:
    kwargs = make_generation().llm.init_kwargs
    assert kwargs["gdn_prefill_backend"] == "triton"
    assert kwargs["compilation_config"] == {"cudagraph_mode": "NONE"}


@pytest.mark.parametrize("backend", VALID_BACKENDS)
def test_backend_is_selectable(make_generation: Any, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setenv("TRL_VLM_FIXES_GDN_PREFILL_BACKEND", backend.upper())
    assert make_generation().llm.init_kwargs["gdn_prefill_backend"] == backend


def test_bad_backend_fails_the_import_naming_the_variable() -> None:
    result = run_python("import trl_vlm_fixes", env={"TRL_VLM_FIXES_GDN_PREFILL_BACKEND": "cutlass"})
    assert result.returncode != 0
    assert "TRL_VLM_FIXES_GDN_PREFILL_BACKEND='cutlass'" in result.stderr and "triton, flashinfer" in result.stderr


def test_a_backend_already_in_the_engine_arguments_wins() -> None:
    from trl_vlm_fixes.engine_args import EngineBuild
    from trl_vlm_fixes.patches.gdn_prefill import contribute

    config = type("Config", (), {"layer_types": ["linear_attention", "full_attention"]})()
    kwargs: dict[str, Any] = {"gdn_prefill_backend": "flashinfer"}
    build = EngineBuild("test", model_config=config)
    contribute(kwargs, build)
    assert kwargs["gdn_prefill_backend"] == "flashinfer" and "kept" in build.changes[0]


def test_switch_off_leaves_the_backend_to_vllm(make_generation: Any, one_fix_off: Any) -> None:
    one_fix_off("gdn_prefill")
    kwargs = make_generation().llm.init_kwargs
    assert "gdn_prefill_backend" not in kwargs and kwargs["compilation_config"] == {"cudagraph_mode": "NONE"}


def test_real_vllm_engine_args_take_both_backends() -> None:
    pytest.importorskip("vllm")
    import dataclasses
    import typing

    from vllm.engine.arg_utils import EngineArgs

    field = next(f for f in dataclasses.fields(EngineArgs) if f.name == "gdn_prefill_backend")
    literal = next(arg for arg in typing.get_args(field.type) if typing.get_origin(arg) is typing.Literal)
    assert set(VALID_BACKENDS) <= set(typing.get_args(literal))


def test_non_gdn_model_engine_is_built_exactly_as_upstream(make_text_generation: Any, caplog: Any) -> None:
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
        with_fixes = dict(make_text_generation().llm.init_kwargs)
    trl_vlm_fixes.revert()
    try:
        upstream = dict(make_text_generation().llm.init_kwargs)
    finally:
        trl_vlm_fixes.apply()
    assert with_fixes == upstream and "compilation_config" not in with_fixes
    lines = [r.getMessage() for r in caplog.records if "builds the colocated vLLM engine" in r.getMessage()]
    assert len(lines) == 1 and "exactly as upstream" in lines[0] and "no Gated-DeltaNet layers" in lines[0]
    assert "cudagraph and gdn_prefill step aside" in lines[0]


def test_engine_settings_line_is_shown_without_any_logging_setup(tiny_model_dir: Path) -> None:
    """One WARNING per engine on stderr through Python's last-resort handler: no logging.basicConfig needed."""
    code = f"""
import os, sys
sys.modules["vllm"] = None
import trl_vlm_fixes
from transformers import AutoProcessor
from trl_vlm_fixes.rollout_schedule import build_generation
build_generation({str(tiny_model_dir)!r}, AutoProcessor.from_pretrained({str(tiny_model_dir)!r}))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], env=environment_without_switches(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "builds the colocated vLLM engine" in line]
    assert len(lines) == 1
    assert "cudagraph_mode=NONE (" in lines[0] and "3-4x slower" in lines[0]
    assert "gdn_prefill_backend=triton (" in lines[0]


def test_trainer_start_shows_every_final_state_once(make_trainer: Any, caplog: Any, monkeypatch: Any) -> None:
    from trl_vlm_fixes import trainer_start

    monkeypatch.setattr(trainer_start, "_announced", False)
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
        make_trainer("grpo")
        make_trainer("rloo")
    lines = [r.getMessage() for r in caplog.records if "python -m trl_vlm_fixes for details" in r.getMessage()]
    assert len(lines) == 1 and "pending" not in lines[0]
    for name in trl_vlm_fixes.status()["patches"]:
        assert f"{name}=" in lines[0]
    assert "watchdog=applied (1800 s)" in lines[0]


# --- the rollout watchdog -------------------------------------------------------------------------------------


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


def test_watchdog_off_means_no_thread_and_no_wrapper(make_generation: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_python(
        """
        import threading
        import trl_vlm_fixes, trl.generation.vllm_generation as vg
        print(json.dumps({"state": trl_vlm_fixes.status()["patches"]["watchdog"]["state"],
                          "threads": [t.name for t in threading.enumerate()]}))
        """,
        env={"TRL_VLM_FIXES_WATCHDOG": "0"},
    )
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["state"] == "disabled" and "trl_vlm_fixes-watchdog" not in report["threads"]


def test_arm_and_disarm_leave_nothing_armed() -> None:
    from trl_vlm_fixes.watchdog import Watchdog

    dog = Watchdog()
    fired: list[int] = []
    tokens = [dog.arm(60, lambda: fired.append(1)) for _ in range(100)]  # type: ignore[arg-type, func-returns-value]
    for token in tokens:
        dog.disarm(token)
    assert dog._armed == {} and not fired
    assert any(t.name == "trl_vlm_fixes-watchdog" for t in threading.enumerate())
