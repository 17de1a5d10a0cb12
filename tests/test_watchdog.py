"""watchdog: a vLLM generate that never returns ends the process with exit 75 and a report; off, nothing runs.

The exit must happen whatever else is broken: stderr replaced or gone, the report file on a filesystem that blocks, a
full stderr pipe, a C call that holds the GIL (``programs/hang_armed.py`` makes each of these).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
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
    assert "LLM.generate (colocate): the wait for the next engine step" in report and "at step 0" in report
    assert "watch: engine-step" in report
    assert ("gdn_prefill_backend=triton" in report) == gdn_prefill_acts() and "resume_from_checkpoint" in report
    assert "cudagraph_mode=vLLM's own (protection armed" in report  # the engine's settings
    assert "vLLM built: " in report and "cudagraph_mode=FULL_AND_PIECEWISE" in report  # read back from it
    # recorded before the report: what the restart here gets (tests/test_resume.py restarts it)
    state = json.loads((tmp_path / "trl_vlm_fixes_protection.json").read_text())
    assert state["level"] == "ENGINE_HANG" and [(h["step"], h["kind"]) for h in state["hangs"]] == [(0, "engine-step")]
    assert "the next engine in this output_dir is built with ENGINE_HANG (cudagraph mode=PIECEWISE" in report
    assert "ran longer than 10 s" in result.stderr and "resume_from_checkpoint" in result.stderr
    hang_to_exit = time.time() - float((tmp_path / "hang_started").read_text())
    assert limit <= hang_to_exit <= limit + 15, hang_to_exit
    print(f"a real generate: exit 75 {hang_to_exit:.1f} s after the hang started (limit {limit} s)")


# validated stack only (CI time): what it shows is the plugin's own or the test program's; on the newest stack the
# watchdog's rules on TRL's calls run in test_a_generate_that_never_returns_ends_the_process_with_75,
# test_a_rollout_that_stops_making_progress_ends_with_75, test_a_hang_on_one_rank_ends_both_under_a_launcher and
# test_a_call_without_progress_that_never_returns_ends_with_75
@pytest.mark.stack_independent
@pytest.mark.slow
def test_without_the_watchdog_the_hang_goes_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Off, the same wedged generate is still hung 10 s + the kernel backstop's delay after it started (the watchdog
    on, at its smallest limit, 10 s, has ended it by then: the test above); timed from the hang, not from the start."""
    from trl_vlm_fixes.patches.watchdog.backstop import EXIT_AFTER_SECONDS

    process = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "hang_generate.py"), str(tiny_model_dir), str(tmp_path)],
        env={**environment_without_switches(), "TRL_VLM_FIXES_WATCHDOG": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        started = tmp_path / "hang_started"
        deadline = time.monotonic() + 240
        while not started.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert started.exists(), process.poll()
        time.sleep(10 + EXIT_AFTER_SECONDS + 2)
        assert process.poll() is None  # still hung
    finally:
        process.kill()
        process.wait()
    assert not (tmp_path / "trl_vlm_fixes_hang_rank0.txt").exists()
    assert not (tmp_path / "trl_vlm_fixes_protection.json").exists()


# validated stack only (CI time): what it shows is the plugin's own or the test program's; on the newest stack the
# watchdog's rules on TRL's calls run in test_a_generate_that_never_returns_ends_the_process_with_75,
# test_a_rollout_that_stops_making_progress_ends_with_75, test_a_hang_on_one_rank_ends_both_under_a_launcher and
# test_a_call_without_progress_that_never_returns_ends_with_75
@pytest.mark.stack_independent
@pytest.mark.slow
def test_a_normal_run_never_fires(tiny_model_dir: Path, tmp_path: Path) -> None:
    result, _ = run_hang_program(tiny_model_dir, tmp_path, {"TRL_VLM_FIXES_WATCHDOG": "20", "HANG_RANK": "-1"}, 300)
    assert result.returncode == 0 and "trained 2" in result.stdout, result.stderr[-3000:]
    assert not list(tmp_path.glob("trl_vlm_fixes_hang_rank*.txt"))


@pytest.mark.slow
# accelerate on the validated stack only (CI time): the same rank hang and exit status run under torchrun on both stacks
@pytest.mark.parametrize("launcher", [pytest.param("accelerate", marks=pytest.mark.stack_independent), "torchrun"])
def test_a_hang_on_one_rank_ends_both_under_a_launcher(launcher: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 1 exits 75; the launcher stops rank 0 and itself exits 1 (torchelastic's ChildFailedError, no restart
    left), naming rank 1's own exit status in its table: what a restart loop around `accelerate launch` or `torchrun`
    sees."""
    from conftest import free_port

    if launcher == "accelerate":
        launch = accelerate_two_cpu_ranks(free_port())
    else:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*launch, str(PROGRAMS / "hang_generate.py"), str(tiny_model_dir), str(tmp_path)]
    env = {
        **environment_without_switches(),
        "TRL_VLM_FIXES_WATCHDOG": "10",
        "HANG_RANK": "1",
        "ACCELERATE_USE_CPU": "1",
    }
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "ChildFailedError" in result.stderr, result.stderr[-3000:]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: 75 ", result.stderr), result.stderr[-3000:]
    assert (tmp_path / "trl_vlm_fixes_hang_rank1.txt").exists()
    assert time.monotonic() - started < 280


HARD_HANGS = {
    "stderr_is_none": {"STDERR": "none"},
    "stderr_without_fileno": {"STDERR": "tee"},
    "stderr_pipe_full": {"STDERR": "full"},
    "report_file_blocks": {"REPORT": "blocks"},
    "c_call_holds_the_gil": {"HANG": "gil"},
}


@pytest.mark.stack_independent
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
    state = tmp_path / "trl_vlm_fixes_protection.json"
    if case == "c_call_holds_the_gil":  # only the kernel timers ran: nothing recorded (documented)
        assert not state.exists()
    else:  # recorded first, even where the report file blocks: the restart's engine is protected
        assert json.loads(state.read_text())["level"] == "ENGINE_HANG", case


@pytest.mark.stack_independent
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


@pytest.mark.stack_independent
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
    from trl_vlm_fixes.patches.watchdog import DEFAULT_SECONDS, SECONDS, parse_seconds

    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG", value)
    assert DEFAULT_SECONDS == 600  # 10 minutes without an engine step
    assert SECONDS.read()[0] == seconds == parse_seconds(value)  # the setting apply() reads, and its parser


@pytest.mark.stack_independent
@pytest.mark.parametrize("value", ["5", "-3", "abc", "9.99", "0.0", "inf", "nan", "1800s"])
def test_bad_watchdog_values_are_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from trl_vlm_fixes.patches.watchdog import SECONDS
    from trl_vlm_fixes.switches import SwitchValueError

    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG", value)
    with pytest.raises(SwitchValueError) as error:
        SECONDS.read()
    with pytest.raises(SwitchValueError, match=re.escape(f"TRL_VLM_FIXES_WATCHDOG={value!r}")):
        SECONDS.read(value)  # trl_vlm_fixes.apply(watchdog={"seconds": value})
    assert f"TRL_VLM_FIXES_WATCHDOG={value!r}" in str(error.value)
    assert "on/true/yes/1" in str(error.value) and "off/false/no/0" in str(error.value)
    assert "at least 10" in str(error.value)


@pytest.mark.stack_independent
@pytest.mark.parametrize(
    ("variable", "value", "accepted"),
    [
        ("TRL_VLM_FIXES_WATCHDOG", "abc", "off/false/no/0 (no watchdog)"),
        ("TRL_VLM_FIXES_WATCHDOG", "5", "off/false/no/0 (no watchdog)"),
        ("TRL_VLM_FIXES_WATCHDOG_RESUME", "maybe", "1/0, true/false"),
    ],
)
def test_bad_watchdog_value_fails_the_import(variable: str, value: str, accepted: str) -> None:
    result = run_python("import trl_vlm_fixes", env={variable: value})
    assert result.returncode != 0 and f"{variable}={value!r}" in result.stderr
    assert accepted in result.stderr


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


# validated stack only (CI time): what it shows is the plugin's own or the test program's; on the newest stack the
# watchdog's rules on TRL's calls run in test_a_generate_that_never_returns_ends_the_process_with_75,
# test_a_rollout_that_stops_making_progress_ends_with_75, test_a_hang_on_one_rank_ends_both_under_a_launcher and
# test_a_call_without_progress_that_never_returns_ends_with_75
@pytest.mark.stack_independent
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
    assert "the wait for the next engine step ran longer than 10 s" in report and "at step 0" in report
    print(f"a stalled rollout: exit 75 {hang_to_exit:.1f} s after its last engine step (limit {limit} s)")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("phase", "named"),
    [
        ("sync_weights", "VLLMGeneration.sync_weights"),
        # validated stack only (CI time): the total-time rule is the one sync_weights runs under on both stacks
        pytest.param("server_generate", "VLLMClient.generate (server mode", marks=pytest.mark.stack_independent),
    ],
)
def test_a_call_without_progress_that_never_returns_ends_with_75(
    phase: str, named: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Its second call hangs: the first (generous limit) taught it, so the limit is the floor (3 x the floor for a
    server generate) or 10 x that call's time; the report names the call, its limit and the rule."""
    result, _ = run_phase_program(tiny_model_dir, tmp_path, {"PHASE": phase, "MAX_STEPS": "2"}, 300)
    exited = time.time()
    assert result.returncode == 75, result.stderr[-3000:]
    report = (tmp_path / "trl_vlm_fixes_hang_rank0.txt").read_text()
    limit = float(re.search(r"ran longer than ([0-9.]+) s", report).group(1))  # type: ignore[union-attr]
    floor = 30 if phase == "server_generate" else 10
    assert floor <= limit < 120 and named in report and "at step 1" in report and f"watch: {phase}" in report
    hang_to_exit = exited - float((tmp_path / "hang_started").read_text())
    assert limit - 2 <= hang_to_exit <= limit + 15, hang_to_exit  # the call began a little before its hang
    print(f"{phase}: exit 75 {hang_to_exit:.1f} s after the hang started (limit {limit} s)")


# validated stack only (CI time): what it shows is the plugin's own or the test program's; on the newest stack the
# watchdog's rules on TRL's calls run in test_a_generate_that_never_returns_ends_the_process_with_75,
# test_a_rollout_that_stops_making_progress_ends_with_75, test_a_hang_on_one_rank_ends_both_under_a_launcher and
# test_a_call_without_progress_that_never_returns_ends_with_75
@pytest.mark.stack_independent
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


def trl_generate(generation: Any, armed: list[Any]) -> Callable[[], Any]:
    """TRL's generate as far as the watchdog cares: a gather across ranks, then the engine call."""

    def call() -> Any:
        armed.append(("gather", len(armed)))  # nothing may be armed while other ranks are waited for
        return generation.llm.generate()

    return call


@pytest.mark.stack_independent
def test_the_limit_is_read_at_apply_not_at_each_generate(
    monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None]
) -> None:
    from types import SimpleNamespace

    from trl_vlm_fixes.patches import watchdog
    from trl_vlm_fixes.registry import value

    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG", "30")
    reapply()  # what apply() does: the setting is read, the limit fixed
    assert value("watchdog", "seconds") == 30
    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG", "abc")  # changed mid-run: neither read nor refused
    armed: list[Any] = []
    monkeypatch.setattr(watchdog.engine.WATCHDOG, "arm", lambda seconds, context: armed.append(seconds) or 0)
    monkeypatch.setattr(watchdog.engine.WATCHDOG, "disarm", lambda token: None)
    monkeypatch.setattr(watchdog.engine.WATCHDOG, "progress", lambda token: None)
    generation = colocated(3)
    assert watchdog.generate_wrapper(trl_generate(generation, armed), generation, (), {}) == 3
    server = SimpleNamespace(mode="server", vllm_client=SimpleNamespace(generate=lambda: "rollout"))
    monkeypatch.setattr(watchdog.limits.SERVER_GENERATE, "completed", False)
    monkeypatch.setattr(watchdog.limits.SERVER_GENERATE, "slowest", 0.0)  # none learned by an earlier test's call
    assert watchdog.generate_wrapper(lambda: server.vllm_client.generate(), server, (), {}) == "rollout"
    # colocate: the progress limit, armed after the gather; server: a total, 10 x the floor for a first call
    assert armed == [("gather", 0), 30, 10 * 30]


@pytest.mark.stack_independent
def test_every_engine_step_restarts_the_clock_and_the_hooks_go_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """Colocate: one progress() per engine step that returned; after the generate (or its error) vLLM's step and
    generate are back; a gather before the engine call runs with nothing armed."""
    from trl_vlm_fixes.patches import watchdog

    monkeypatch.setattr(watchdog, "_floor", lambda: 30.0)
    armed: list[Any] = []
    progressed: list[int] = []
    monkeypatch.setattr(watchdog.engine.WATCHDOG, "arm", lambda seconds, context: armed.append(seconds) or 7)
    monkeypatch.setattr(watchdog.engine.WATCHDOG, "progress", progressed.append)
    generation = colocated(5)
    own_generate = generation.llm.generate
    assert watchdog.generate_wrapper(trl_generate(generation, armed), generation, (), {}) == 5
    assert armed == [("gather", 0), 30.0] and progressed == [7] * 5  # one watch, its clock restarted per step
    assert "step" not in vars(generation.llm.llm_engine) and generation.llm.generate is own_generate

    def fails() -> None:
        generation.llm.llm_engine.step()  # a step outside the engine call: no watch, no progress
        generation.llm.generate()
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError):
        watchdog.generate_wrapper(fails, generation, (), {})
    assert "step" not in vars(generation.llm.llm_engine) and generation.llm.generate is own_generate
    assert len(progressed) == 5 + 5


@pytest.mark.stack_independent
def test_watches_are_independent_and_progress_restarts_a_clock() -> None:
    from trl_vlm_fixes.patches.watchdog.timer import Watchdog

    dog = Watchdog()
    never: Any = lambda: pytest.fail("fired")  # noqa: E731
    push = dog.arm(1000, never)
    wake = dog.arm(30, never)  # a wake-up inside the push: its own limit, the push's clock runs on
    first = dog._armed[wake].deadline
    time.sleep(0.05)
    dog.progress(wake)
    assert dog._armed[wake].deadline > first and 999 < dog._armed[push].deadline - time.monotonic() <= 1000
    dog.disarm(wake)
    dog.disarm(push)
    dog.disarm(push)  # twice: nothing
    assert dog._armed == {}


@pytest.mark.stack_independent
def test_arm_and_disarm_leave_nothing_armed() -> None:
    from trl_vlm_fixes.patches.watchdog.timer import Watchdog

    dog = Watchdog()
    fired: list[int] = []
    tokens = [dog.arm(60, lambda: fired.append(1)) for _ in range(100)]  # type: ignore[arg-type, func-returns-value]
    for token in tokens:
        dog.disarm(token)
    assert dog._armed == {} and not fired
    assert any(t.name == "trl_vlm_fixes-watchdog" for t in threading.enumerate())


class Owner:
    """A trainer as the watchdog reads it: rank, step, output_dir."""

    def __init__(self, output_dir: Path, rank: int = 0) -> None:
        self.args = type("Args", (), {"output_dir": str(output_dir)})()
        self.accelerator = type("Accelerator", (), {"process_index": rank})()
        self.state = type("State", (), {"global_step": 4})()


@pytest.mark.stack_independent
def test_a_first_call_is_generous_then_limits_are_learned_and_kept_across_a_restart(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A first push of 12 s with a 10 s floor: allowed (10 x the floor for a first call); then the larger of the floor
    and 10 x the slowest completed call; the restart reads the learned limit back from output_dir."""
    from trl_vlm_fixes.patches.watchdog import limits, owners

    armed: list[float] = []
    monkeypatch.setattr(limits.WATCHDOG, "arm", lambda seconds, context: armed.append(seconds) or 0)
    monkeypatch.setattr(limits.WATCHDOG, "disarm", lambda token: None)
    phase = limits.Phase("sync_weights", "a test phase", "a test")
    monkeypatch.setattr(limits, "PHASES", (phase,))
    trainer, watched = Owner(tmp_path), Owner(tmp_path)  # the watched object: any weak-referenceable one
    owners.remember(trainer, watched)
    clock = iter([100.0, 112.0, 200.0, 201.0, 300.0, 300.5])  # a first call of 12 s, then calls of 1 s and 0.5 s
    monkeypatch.setattr(limits.time, "monotonic", lambda: next(clock))
    for _ in range(3):
        limits.run_watched(phase, 10.0, watched, lambda: None)
    assert armed == [100.0, 120.0, 120.0]
    with pytest.raises(ValueError):  # a call that raised teaches nothing
        monkeypatch.setattr(limits.time, "monotonic", lambda: 0.0)
        limits.run_watched(phase, 10.0, watched, lambda: int("x"))
    assert phase.slowest == 12.0
    kept = json.loads((tmp_path / "trl_vlm_fixes_watchdog_limits_rank0.json").read_text())
    assert kept == {"sync_weights": 12.0}

    restarted = limits.Phase("sync_weights", "a test phase", "a test")  # a new process: nothing learned yet
    monkeypatch.setattr(limits, "PHASES", (restarted,))
    assert restarted.limit(10.0) == 100.0
    restarted.completed = True
    assert restarted.limit(10.0) == 10.0
    limits.restore(tmp_path)
    assert restarted.limit(10.0) == 120.0  # what the last run learned
    # a server generate: 10 x the floor first, then 3 x (the declared phase, as a process starts with it: another
    # test in this worker may have completed one already)
    server = dataclasses.replace(limits.SERVER_GENERATE, slowest=0.0, completed=False)
    assert server.base(10.0) == 100.0 and dataclasses.replace(server, completed=True).base(10.0) == 30.0


@pytest.mark.stack_independent
def test_a_push_that_waits_on_other_ranks_is_left_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ZeRO-3 or FSDP the push gathers parameters across ranks (a wait torch's process-group timeout covers):
    not watched; an unsharded push is."""
    from types import SimpleNamespace

    from trl_vlm_fixes.patches import watchdog

    monkeypatch.setattr(watchdog, "_floor", lambda: 10.0)
    armed: list[float] = []
    monkeypatch.setattr(watchdog.limits.WATCHDOG, "arm", lambda seconds, context: armed.append(seconds) or 0)
    monkeypatch.setattr(watchdog.limits.WATCHDOG, "disarm", lambda token: None)
    wrapper = watchdog.FIX.targets[1].wrapper
    for state, watched in (
        (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3), fsdp_plugin=None), False),
        (SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=object()), False),
        (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2), fsdp_plugin=None), True),
        (SimpleNamespace(), True),
    ):
        armed.clear()
        generation = SimpleNamespace(accelerator=SimpleNamespace(state=state))
        assert wrapper(lambda: "pushed", generation, (), {}) == "pushed"
        assert bool(armed) is watched, state


@pytest.mark.slow
def test_the_engine_build_is_not_watched_its_later_sleeps_are(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """TRL's _init_vllm puts the new engine to sleep: part of the build, not watched (and no report to `.`). Once
    the trainer is built, the engine's sleep and wake-up are watched, their reports in its output_dir, and the limits
    an earlier run learned there are read back (a wake-up that took 30 s: 10 x that, above a first call's 10 x 10 s)."""
    from types import SimpleNamespace

    import trl.generation.vllm_generation as vllm_generation
    from vllm import LLM

    from trl_vlm_fixes.patches import watchdog

    calls: list[str] = []

    class SleepyEngine(LLM):  # vLLM's own sleep and wake_up (wrapped on vllm.LLM), over no engine at all
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.llm_engine = SimpleNamespace(
                sleep=lambda level, mode="abort": calls.append(f"sleep {level}"),
                wake_up=lambda tags=None: calls.append("wake_up"),
            )

    armed: list[Any] = []
    for phase in watchdog.limits.PHASES:  # this process's learned limits, put back after the test
        monkeypatch.setattr(phase, "slowest", 0.0)
        monkeypatch.setattr(phase, "completed", False)
    monkeypatch.setattr(watchdog, "_floor", lambda: 10.0)
    monkeypatch.setattr(watchdog.limits.WATCHDOG, "arm", lambda seconds, context: armed.append((seconds, context())))
    monkeypatch.setattr(watchdog.limits.WATCHDOG, "disarm", lambda token: None)
    monkeypatch.setattr(vllm_generation, "LLM", SleepyEngine)
    learned_before = tmp_path / "grpo" / "trl_vlm_fixes_watchdog_limits_rank1.json"  # the run this one replaces
    learned_before.parent.mkdir()
    learned_before.write_text(json.dumps({"wake_up": 30.0}))
    trainer = make_trainer("grpo", use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)
    assert calls == ["sleep 2"] and armed == []  # the build's sleep
    trainer.vllm_generation.llm.wake_up(tags=["weights"])
    trainer.vllm_generation.llm.sleep(level=2)
    assert calls == ["sleep 2", "wake_up", "sleep 2"]
    where = trainer.args.output_dir
    watched = [(seconds, context.watch, context.output_dir) for seconds, context in armed]
    assert watched == [(300.0, "wake_up", where), (100.0, "sleep", where)]


@pytest.mark.stack_independent
@pytest.mark.parametrize("watch", ["engine-step", "engine_generate", "sync_weights", "wake_up", "server_generate"])
def test_only_an_engine_without_progress_raises_the_level(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, watch: str
) -> None:
    """The report writer records the hang in the state before the report: an engine without progress (its step rule,
    or the total-time rule of an engine without steps) raises the level; a weight push, a sleep, a wake-up or a
    server generate is recorded and keeps it (at NONE too: before, a wake-up hang at NONE made the next start build
    vLLM's own graphs again). The report's lines say so."""
    from trl_vlm_fixes import protection
    from trl_vlm_fixes.patches.watchdog import escalation, limits, report

    assert {limits.ENGINE_GENERATE.key, report.ENGINE_STEP} == set(escalation.ENGINE_WATCHES)
    assert limits.SERVER_GENERATE.key == escalation.SERVER_GENERATE
    engine = watch in escalation.ENGINE_WATCHES
    for built in protection.Level:
        folder = tmp_path / built.name
        if built:
            protection.write_state(folder, built, [])
        monkeypatch.setattr(protection, "_last_built", built)
        lines = escalation.record(watch, 3, 0, str(folder))
        level, hangs = protection.read_state(folder)
        assert level == (protection.Level(min(built + 1, 2)) if engine else built), (watch, built)
        assert hangs[-1]["kind"] == watch and hangs[-1]["step"] == 3 and hangs[-1]["engine"] is engine
        text = report.hang_report(10, report.HangContext("a call", 0, 3, str(folder), "-", "-", watch), lines)
        said = "the next engine in this output_dir is built with" if engine else "leaves the level as it was"
        assert f"{said} {level.name}" in text.replace("as it was (", "as it was "), text


def test_a_report_that_cannot_record_says_the_restart_is_unprotected(tmp_path: Path) -> None:
    """A state that cannot be written (here a directory holds its name): the report says so and names the pin."""
    from trl_vlm_fixes.patches.watchdog import escalation

    (tmp_path / "trl_vlm_fixes_protection.json").mkdir()
    with pytest.raises(OSError):
        escalation.record("engine-step", 3, 0, str(tmp_path))
    assert "the restart here is not protected" in escalation.not_recorded("x")[0]


def test_a_server_generate_report_names_the_flag_that_protects_the_server(tmp_path: Path) -> None:
    """No process of the server reads the trainer's output_dir: the report says how to restart the server protected
    (TRL 1.9.1 under the launcher: the mode's variable; TRL >= 1.11: vLLM's own flag), NONE from the second server
    hang recorded there; the level of the trainer's output_dir is not raised."""
    from helpers import server_engine_build_problem_in_llm_worker

    from trl_vlm_fixes import protection
    from trl_vlm_fixes.patches.watchdog import escalation

    once = "\n".join(escalation.record("server_generate", 3, 0, str(tmp_path)))
    again = "\n".join(escalation.record("server_generate", 3, 0, str(tmp_path)))
    if server_engine_build_problem_in_llm_worker():  # TRL 1.9.1: the plugin builds the server's engine
        assert "restart it with `TRL_VLM_FIXES_CUDAGRAPH_MODE=PIECEWISE trl-vlm-fixes run -- trl vllm-serve" in once
        assert "`TRL_VLM_FIXES_CUDAGRAPH_MODE=NONE trl-vlm-fixes run" in again
    else:
        assert """`trl vllm-serve ... --compilation-config '{"cudagraph_mode": "PIECEWISE"}'`""" in once
        assert """--compilation-config '{"cudagraph_mode": "NONE"}'""" in again
    assert protection.read_state(tmp_path)[0] == protection.Level.NO_HANG  # nothing built here


def test_the_progress_it_counts_is_the_installed_vllms_engine_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The colocated watch counts ``llm_engine.step()`` returns: the installed vLLM's ``LLM.generate`` must loop on
    them (read from its source), and where it would not, the watch falls back to a total-time limit instead of
    ending a healthy rollout that shows no steps."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from trl_vlm_fixes.patches.watchdog import engine

    assert engine.generate_steps_the_engine() is True

    def step() -> str:
        return "step"

    llm = SimpleNamespace(llm_engine=SimpleNamespace(step=step), generate=lambda: "out")
    with engine.watch_engine(llm, 600.0, None):
        assert llm.llm_engine.step is not step  # the progress hook
    monkeypatch.setattr(engine, "generate_steps_the_engine", lambda: False)
    with engine.watch_engine(llm, 600.0, None):
        assert llm.llm_engine.step is step  # no progress hook where vLLM takes no steps: the total-time watch
        assert llm.generate() == "out"
