"""watchdog: a vLLM generate that never returns ends the process with exit 75 and a report; off, nothing runs.

The exit must happen whatever else is broken: stderr replaced or gone, the report file on a filesystem that blocks, a
full stderr pipe, a C call that holds the GIL (``programs/hang_armed.py`` makes each of these).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    accelerate_two_cpu_ranks,
    environment_without_switches,
    gdn_prefill_acts,
    last_json,
    run_python,
)

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
    limit = 10
    result, _ = run_hang_program(tiny_model_dir, tmp_path, {"TRL_VLM_FIXES_WATCHDOG": str(limit)}, 240)
    assert result.returncode == 75, result.stderr[-3000:]
    report = (tmp_path / "trl_vlm_fixes_hang_rank0.txt").read_text()
    assert "VLLMGeneration.generate" in report and "at step 0" in report
    assert ("gdn_prefill_backend=triton" in report) == gdn_prefill_acts() and "resume_from_checkpoint" in report
    assert "cudagraph_mode=PIECEWISE" in report  # the engine's settings
    assert "ran longer than 10 s" in result.stderr and "resume_from_checkpoint" in result.stderr
    hang_to_exit = time.time() - float((tmp_path / "hang_started").read_text())
    assert limit <= hang_to_exit <= limit + 15, hang_to_exit
    print(f"a real generate: exit 75 {hang_to_exit:.1f} s after the hang started (limit {limit} s)")


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

    command = [
        *accelerate_two_cpu_ranks(free_port()),
        str(PROGRAMS / "hang_generate.py"),
        str(tiny_model_dir),
        str(tmp_path),
    ]
    env = {
        **environment_without_switches(),
        "TRL_VLM_FIXES_WATCHDOG": "10",
        "HANG_RANK": "1",
        "ACCELERATE_USE_CPU": "1",
    }
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode != 0, result.stderr[-3000:]
    assert (tmp_path / "trl_vlm_fixes_hang_rank1.txt").exists()
    assert "exitcode  : 75" in result.stderr or "exit code 75" in result.stderr, result.stderr[-3000:]
    assert time.monotonic() - started < 280


HARD_HANGS = {
    "stderr_is_none": {"STDERR": "none"},
    "stderr_without_fileno": {"STDERR": "tee"},
    "stderr_pipe_full": {"STDERR": "full"},
    "report_file_blocks": {"REPORT": "blocks"},
    "c_call_holds_the_gil": {"HANG": "gil"},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HARD_HANGS))
def test_the_watchdog_ends_every_hard_hang_with_75(case: str, tmp_path: Path) -> None:
    limit = 3
    env = {**environment_without_switches(), "PYTHONPATH": str(Path(__file__).parents[1]), **HARD_HANGS[case]}
    command = [sys.executable, str(PROGRAMS / "hang_armed.py"), str(tmp_path), str(limit)]
    with open(tmp_path / "stderr.txt", "wb") as stderr_file:
        # a pipe nobody reads stays full; elsewhere stderr goes to a file, so nothing blocks that should not
        stderr = subprocess.PIPE if case == "stderr_pipe_full" else stderr_file
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            returncode = process.wait(timeout=limit + 60)
        finally:
            process.kill()
        exited = time.time()
    stderr_text = (tmp_path / "stderr.txt").read_text(errors="replace")
    assert returncode == 75, stderr_text[-3000:]
    hang_to_exit = exited - float((tmp_path / "hang_started").read_text())
    assert limit <= hang_to_exit <= limit + 15, hang_to_exit
    print(f"{case}: exit 75 {hang_to_exit:.1f} s after the hang started (limit {limit} s)")
    if case == "c_call_holds_the_gil":  # only C runs: faulthandler's stacks, down to the hung call
        assert "hang_armed.py" in stderr_text and "in main" in stderr_text, stderr_text[-3000:]
    elif case != "stderr_pipe_full":
        assert "a test hang ran longer than 3 s" in stderr_text and "__main__:main" in stderr_text
    if case not in ("c_call_holds_the_gil", "report_file_blocks"):
        assert "at step 7" in (tmp_path / "trl_vlm_fixes_hang_rank0.txt").read_text()


@pytest.mark.slow
def test_a_disarmed_watchdog_never_fires() -> None:
    """The backstop's kernel timers are cleared with the last disarm: a healthy run outlives every delay."""
    result = run_python(
        """
        import time
        from trl_vlm_fixes.patches.watchdog import backstop
        from trl_vlm_fixes.patches.watchdog.timer import WATCHDOG
        tokens = [WATCHDOG.arm(1, lambda: None), WATCHDOG.arm(2, lambda: None)]
        for token in tokens:
            WATCHDOG.disarm(token)
        time.sleep(2 + backstop.EXIT_AFTER_SECONDS + 1)
        print(json.dumps({"backstop": type(WATCHDOG._backstop).__name__}))
        """
    )
    assert last_json(result) == {"backstop": "_PosixTimers"}


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("", 600),
        ("on", 600),
        ("TRUE", 600),
        ("yes", 600),
        ("1", 600),
        ("off", 0),
        ("False", 0),
        ("no", 0),
        ("0", 0),
        ("10", 10),
        ("45.5", 45.5),
        (" 600 ", 600),
    ],
)
def test_watchdog_switch_values(value: str, seconds: float, monkeypatch: pytest.MonkeyPatch) -> None:
    from trl_vlm_fixes.switches import DEFAULT_WATCHDOG_SECONDS, watchdog_seconds

    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG", value)
    assert DEFAULT_WATCHDOG_SECONDS == 600  # 10 minutes without an engine step
    assert watchdog_seconds() == seconds


@pytest.mark.parametrize("value", ["5", "-3", "abc", "9.99", "0.0", "inf", "nan", "1800s"])
def test_bad_watchdog_values_are_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from trl_vlm_fixes.switches import SwitchValueError, watchdog_seconds

    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG", value)
    with pytest.raises(SwitchValueError) as error:
        watchdog_seconds()
    assert f"TRL_VLM_FIXES_WATCHDOG={value!r}" in str(error.value)
    assert "on/true/yes/1" in str(error.value) and "off/false/no/0" in str(error.value)
    assert "at least 10" in str(error.value)


@pytest.mark.parametrize("value", ["abc", "5"])
def test_bad_watchdog_value_fails_the_import(value: str) -> None:
    result = run_python("import trl_vlm_fixes", env={"TRL_VLM_FIXES_WATCHDOG": value})
    assert result.returncode != 0 and f"TRL_VLM_FIXES_WATCHDOG={value!r}" in result.stderr
    assert "off/false/no/0 (no watchdog)" in result.stderr


def colocated(steps: int) -> Any:
    """A VLLMGeneration in colocate mode whose engine runs ``steps`` engine steps per generate (as vLLM's loop)."""
    from types import SimpleNamespace

    from trl_vlm_fixes.selftest.engine_standin import RequestOutput, _EngineLoop

    engine = _EngineLoop()

    def generate() -> int:
        engine.admit([RequestOutput([1], [SimpleNamespace(token_ids=[2] * steps)])])  # type: ignore[list-item]
        while engine.has_unfinished_requests():
            engine.step()
        return engine.steps

    return SimpleNamespace(mode="colocate", llm=SimpleNamespace(llm_engine=engine, generate=generate))


def test_the_limit_is_read_at_apply_not_at_each_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from trl_vlm_fixes.patches import watchdog

    monkeypatch.setattr(watchdog, "_limit", watchdog._limit)  # put back afterwards
    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG", "30")
    assert watchdog.selected_limit() == 30  # what apply() does
    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG", "abc")  # changed mid-run: neither read nor refused
    armed: list[float] = []
    monkeypatch.setattr(watchdog.WATCHDOG, "arm", lambda seconds, context: armed.append(seconds) or 0)
    monkeypatch.setattr(watchdog.WATCHDOG, "disarm", lambda token: None)
    monkeypatch.setattr(watchdog.WATCHDOG, "progress", lambda token: None)
    generation = colocated(3)
    assert watchdog.generate_wrapper(lambda: generation.llm.generate(), generation, (), {}) == 3
    server = SimpleNamespace(mode="server", llm=None)
    assert watchdog.generate_wrapper(lambda: "rollout", server, (), {}) == "rollout"
    assert armed == [30, 3 * 30]  # colocate: the progress limit; server: a total, 3x it until one has completed


def test_every_engine_step_restarts_the_clock_and_the_hook_goes_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """Colocate: one progress() per engine step that returned; after the generate (or its error) vLLM's step is back."""
    from trl_vlm_fixes.patches import watchdog

    monkeypatch.setattr(watchdog, "_limit", 30.0)
    progressed: list[int] = []
    monkeypatch.setattr(watchdog.WATCHDOG, "progress", progressed.append)
    generation = colocated(5)
    assert watchdog.generate_wrapper(lambda: generation.llm.generate(), generation, (), {}) == 5
    assert len(progressed) == 5 and len(set(progressed)) == 1  # one watch, re-armed per step
    assert "step" not in vars(generation.llm.llm_engine)

    def fails() -> None:
        generation.llm.llm_engine.step()
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError):
        watchdog.generate_wrapper(fails, generation, (), {})
    assert "step" not in vars(generation.llm.llm_engine) and len(progressed) == 6
    assert not watchdog.WATCHDOG._armed


def test_an_inner_watch_stops_the_outer_clock_and_progress_restarts_it() -> None:
    import math

    from trl_vlm_fixes.patches.watchdog.timer import Watchdog

    dog = Watchdog()
    never: Any = lambda: pytest.fail("fired")  # noqa: E731
    outer = dog.arm(30, never)
    first = dog._armed[outer].deadline
    time.sleep(0.05)
    dog.progress(outer)
    assert dog._armed[outer].deadline > first  # a step returned: the full limit again
    inner = dog.arm(1000, never)  # a weight push inside the generate: its own, longer limit
    assert dog._armed[outer].deadline == math.inf
    dog.progress(outer)  # no effect while the inner call is watched
    assert dog._armed[outer].deadline == math.inf
    dog.disarm(inner)
    assert 29 < dog._armed[outer].deadline - time.monotonic() <= 30
    dog.disarm(outer)
    assert dog._armed == {} and dog._stacks == {}


def test_a_phase_limit_is_learned_from_its_completed_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl_vlm_fixes.patches.watchdog import phases

    armed: list[float] = []
    monkeypatch.setattr(phases.WATCHDOG, "arm", lambda seconds, context: armed.append(seconds) or 0)
    monkeypatch.setattr(phases.WATCHDOG, "disarm", lambda token: None)
    phase = phases.Phase("a test phase", "a test")
    clock = iter([100.0, 160.0, 200.0, 201.0, 300.0, 301.0, 400.0])  # a call of 60 s, then two of 1 s
    monkeypatch.setattr(phases.time, "monotonic", lambda: next(clock))
    for _ in range(3):
        phases.run_watched(phase, 20.0, None, lambda: None)
    assert armed == [20.0, 600.0, 600.0]  # the floor until one completed, then 10 x the slowest completed call
    with pytest.raises(ValueError):  # a call that raised teaches nothing
        phases.run_watched(phase, 20.0, None, lambda: int("x"))
    assert phase.slowest == 60.0


def run_phase_program(tiny_model_dir: Path, tmp_path: Path, env: dict[str, str], timeout: float) -> Any:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(PROGRAMS / "hang_phase.py"), str(tiny_model_dir), str(tmp_path)],
        env={**environment_without_switches(), "TRL_VLM_FIXES_WATCHDOG": "10", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result, time.monotonic() - started


@pytest.mark.slow
def test_a_rollout_that_keeps_making_progress_is_never_killed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """40 engine steps of 1 s: one generate of more than 3x the 10 s limit, each step well within it."""
    env = {"PHASE": "steady", "STEP_SECONDS": "1", "TOKENS": "40"}
    result, _ = run_phase_program(tiny_model_dir, tmp_path, env, 300)
    assert result.returncode == 0 and "trained 1" in result.stdout, result.stderr[-3000:]
    seconds = float(result.stdout.split(" in ")[1].split(" s")[0])
    assert seconds > 3 * 10 and "40 engine steps" in result.stdout, result.stdout
    assert not list(tmp_path.glob("trl_vlm_fixes_hang_rank*.txt"))


@pytest.mark.slow
def test_a_rollout_that_stops_making_progress_ends_with_75(tiny_model_dir: Path, tmp_path: Path) -> None:
    """6 steps of 2 s (longer than the limit in all), then a step that never returns: exit 75 one limit later."""
    limit = 10
    env = {"PHASE": "stalls", "STEP_SECONDS": "2", "STEADY_STEPS": "6", "TOKENS": "40"}
    result, _ = run_phase_program(tiny_model_dir, tmp_path, env, 240)
    exited = time.time()
    assert result.returncode == 75, result.stderr[-3000:]
    hang_to_exit = exited - float((tmp_path / "hang_started").read_text())
    assert limit <= hang_to_exit <= limit + 15, hang_to_exit
    report = (tmp_path / "trl_vlm_fixes_hang_rank0.txt").read_text()
    assert "the wait for the next vLLM engine step ran longer than 10 s" in report and "at step 0" in report
    print(f"a stalled rollout: exit 75 {hang_to_exit:.1f} s after its last engine step (limit {limit} s)")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "named"),
    [("sync_weights", "VLLMGeneration.sync_weights"), ("optimizer_step", "the optimizer step")],
)
def test_a_hang_in_another_phase_ends_with_75(phase: str, named: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    limit = 10
    result, _ = run_phase_program(tiny_model_dir, tmp_path, {"PHASE": phase}, 240)
    exited = time.time()
    assert result.returncode == 75, result.stderr[-3000:]
    hang_to_exit = exited - float((tmp_path / "hang_started").read_text())
    assert limit - 2 <= hang_to_exit <= limit + 15, hang_to_exit  # the phase began a little before its hang
    report = (tmp_path / "trl_vlm_fixes_hang_rank0.txt").read_text()
    assert named in report and "ran longer than 10 s" in report and "at step 0" in report, report[:2000]
    print(f"{phase}: exit 75 {hang_to_exit:.1f} s after the hang started (limit {limit} s)")


@pytest.mark.slow
def test_watchdog_off_means_no_thread_even_after_a_generate(tiny_model_dir: Path) -> None:
    """Off: a real generate runs and no thread appears; switched on (apply() again), the same generate starts it."""
    result = run_python(
        f"""
        import os, threading
        import trl_vlm_fixes
        from transformers import AutoProcessor
        from trl_vlm_fixes.selftest.rollout_schedule import build_generation

        generation = build_generation({str(tiny_model_dir)!r}, AutoProcessor.from_pretrained({str(tiny_model_dir)!r}))
        def threads_after_a_generate():
            generation.generate(prompts=[[1, 2, 3]], images=None, num_generations=1)
            return [t.name for t in threading.enumerate()]
        off = threads_after_a_generate()
        state_off = trl_vlm_fixes.status()["patches"]["watchdog"]["state"]
        os.environ["TRL_VLM_FIXES_WATCHDOG"] = "on"
        trl_vlm_fixes.revert()
        trl_vlm_fixes.apply()
        print(json.dumps({{"off": off, "state_off": state_off, "on": threads_after_a_generate()}}))
        """,
        env={"TRL_VLM_FIXES_WATCHDOG": "0"},
    )
    report = last_json(result)
    assert "trl_vlm_fixes-watchdog" not in report["off"], report
    assert report["state_off"] == "disabled"
    assert "trl_vlm_fixes-watchdog" in report["on"]  # the check can fail: a generate does start the thread


def test_arm_and_disarm_leave_nothing_armed() -> None:
    from trl_vlm_fixes.patches.watchdog.timer import Watchdog

    dog = Watchdog()
    fired: list[int] = []
    tokens = [dog.arm(60, lambda: fired.append(1)) for _ in range(100)]  # type: ignore[arg-type, func-returns-value]
    for token in tokens:
        dog.disarm(token)
    assert dog._armed == {} and not fired
    assert any(t.name == "trl_vlm_fixes-watchdog" for t in threading.enumerate())


def test_the_first_watched_call_after_a_checkpoint_save_may_wait_for_rank_0() -> None:
    """Under DDP only rank 0 writes a checkpoint and the others wait for it in their next watched call: that call gets
    the save grace, once; the wrapper on transformers' _save_checkpoint (called by every rank) grants it."""
    import transformers.trainer

    from trl_vlm_fixes.patches.watchdog import phases

    assert phases.with_save_grace(600.0, 600.0) == 600.0
    phases.save_wrapper(lambda: None, None, (), {})
    assert phases.with_save_grace(600.0, 600.0) == phases.SAVE_GRACE_FACTOR * 600.0 > 600.0
    assert phases.with_save_grace(600.0, 600.0) == 600.0  # once
    import trl_vlm_fixes

    assert transformers.trainer.Trainer  # imported: the wrapper is in place
    assert "Trainer._save_checkpoint wrapped" in trl_vlm_fixes.status()["patches"]["watchdog"]["detail"]
