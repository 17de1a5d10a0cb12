"""watchdog/resume: a restart after a watchdog exit resumes from the last checkpoint that can resume, on the resumed
weights; the protection state in output_dir makes every later engine there PIECEWISE after an engine hang, NONE after
a second (at any step), through crashes and other hangs, the same on every rank (a tensor-parallel group that would
differ stops at build); a healthy run (a slow first weight push, a slow checkpoint save under tensor parallelism) is
never ended nor escalated.

Upstream (``TRL_VLM_FIXES_WATCHDOG_RESUME=0``, or the fixes reverted) a restarted job starts again from step 0:
``trl grpo`` calls ``train()`` with no checkpoint and transformers ignores the field of the training arguments.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import environment_without_switches, gdn_prefill_acts, upstream_reloads_from_disk

PROGRAM = Path(__file__).parent / "programs" / "resume_ranks.py"
LIMIT = "10"  # the smallest watchdog limit the switch accepts
OFF = {"TRL_VLM_FIXES_WATCHDOG_RESUME": "0"}


def attempts(records: Path, rank: int) -> list[list[dict[str, Any]]]:
    """One list of records per process (attempt) of ``rank``, in the order they ran."""
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for line in (records / f"rank{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        by_pid.setdefault(entry["pid"], []).append(entry)
    return list(by_pid.values())


def first_rollout(attempt: list[dict[str, Any]]) -> dict[str, Any]:
    return next(entry for entry in attempt if entry["event"] == "generate")


def run_program(command: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    environment = {**environment_without_switches(), "HF_HUB_OFFLINE": "1", "TRL_VLM_FIXES_WATCHDOG": LIMIT, **env}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)


STATE = "trl_vlm_fixes_protection.json"


def state(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / STATE).read_text()))


def run_ranks(model_dir: Path, base: Path, env: dict[str, str], restarts: int = 1) -> tuple[Any, Path, Path]:
    """resume_ranks.py under ``torchrun --max-restarts N`` (2 CPU ranks, gloo); by default rank 1 wedges once at step
    3 of 4.

    ``--standalone`` (c10d rendezvous): each restart round gets fresh rendezvous keys, so a restarted gloo group never
    reads the dead round's addresses."""
    out, records = base / "out", base / "records"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*torchrun, "--max-restarts", str(restarts), str(PROGRAM), str(model_dir), str(out), str(records)]
    started = time.monotonic()
    result = run_program(command, {"MAX_STEPS": "4", "WEDGE_RANK": "1", "WEDGE_STEP": "3", **env}, timeout=400)
    seconds = time.monotonic() - started
    print(f"torchrun, 2 ranks, {env or 'one hang, one restart'}: exit {result.returncode} in {seconds:.0f} s")
    return result, out, records


def single(model_dir: Path, base: Path, env: dict[str, str]) -> Any:
    """One process of resume_ranks.py in ``base`` (rank 0 wedges at step 3 of 4, WEDGE_TIMES times over all runs)."""
    command = [sys.executable, str(PROGRAM), str(model_dir), str(base / "out"), str(base / "records")]
    started = time.monotonic()
    result = run_program(command, {"MAX_STEPS": "4", "WEDGE_RANK": "0", "WEDGE_STEP": "3", **env})
    print(f"one process, {env}: exit {result.returncode} in {time.monotonic() - started:.0f} s")
    return result


def engine_arguments(base: Path, attempt: int, rank: int = 0) -> tuple[Any, Any]:
    """What the engine of that attempt received in TRL's ``LLM(...)`` call (the stand-in's ``init_kwargs``)."""
    start = attempts(base / "records", rank)[attempt][0]
    assert start["event"] == "start"
    return start["compilation_config"], start["gdn_prefill_backend"]


def built_mode(base: Path, attempt: int) -> str:
    """The CUDA-graph mode the engine of that attempt reports (its ``vllm_config``, as vLLM's would)."""
    return str(attempts(base / "records", 0)[attempt][0]["built_mode"])


TRITON = "triton" if gdn_prefill_acts() else None


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_torchrun_restart_after_a_hang_starts_from_step_0_upstream(tiny_model_dir: Path, tmp_path: Path) -> None:
    result, out, records = run_ranks(tiny_model_dir, tmp_path, OFF)
    # torchrun names rank 1's own exit status, restarts both ranks, and exits 0 once the restarted round ends well
    assert "failed (exitcode: 75) local_rank: 1" in result.stderr and result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        _, restarted = attempts(records, rank)
        assert first_rollout(restarted)["step"] == 0 and first_rollout(restarted)["on_base"]  # from scratch
        assert restarted[-1] == {"event": "end", "pid": restarted[0]["pid"], "steps": 4}
    # the restart read the report (its engine's protection) and marked it used, though it did not resume: a later
    # start in this output_dir is a fresh one
    assert (out / "trl_vlm_fixes_hang_rank1.resumed.txt").exists() and not (
        out / "trl_vlm_fixes_hang_rank1.txt"
    ).exists()


@pytest.mark.slow
# tp 2 on the validated stack only (CI time): the pair's agreement is the plugin's own; TRL's path runs at tp 1 on both
@pytest.mark.parametrize("tp", ["1", pytest.param("2", marks=pytest.mark.stack_independent)])
def test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights(
    tiny_model_dir: Path, tmp_path: Path, tp: str
) -> None:
    """Rank 1's engine wedges at step 3: the watchdog ends it (75), torchrun ends rank 0 and restarts both; both
    resume from checkpoint-3 (rank 0 wrote no report: it reads rank 1's), both ranks' engines are built PIECEWISE
    from the one state (vllm_tensor_parallel_size 1 and 2: the pair compares what it builds), the first rollout runs
    on the resumed weights on both ranks, training ends at exactly max_steps, and the report is marked as used."""
    from trl_vlm_fixes.patches.watchdog.resume import unused_reports

    result, out, records = run_ranks(tiny_model_dir, tmp_path, {"TP": tp})
    assert "failed (exitcode: 75) local_rank: 1" in result.stderr and result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count("ended by the watchdog (hang at step 3") == 1  # one line, from rank 0
    assert f"resuming from {out / 'checkpoint-3'}" in result.stderr
    for rank in (0, 1):
        hung, resumed = attempts(records, rank)
        assert [e["step"] for e in hung if e["event"] == "generate"][:3] == [0, 1, 2]
        assert not any(e["event"] == "end" for e in hung)
        assert [e["step"] for e in resumed if e["event"] == "generate"] == [3]
        assert first_rollout(resumed)["on_trainer"] and not first_rollout(resumed)["on_base"]
        assert resumed[-1] == {"event": "end", "pid": resumed[0]["pid"], "steps": 4}
        assert engine_arguments(tmp_path, 0, rank)[0] is None  # the first round: vLLM's own graphs
        assert engine_arguments(tmp_path, 1, rank) == ({"cudagraph_mode": "PIECEWISE"}, TRITON), rank
    assert unused_reports(out) == {} and (out / "trl_vlm_fixes_hang_rank1.resumed.txt").exists()
    assert state(out)["level"] == "ENGINE_HANG" and [h["rank"] for h in state(out)["hangs"]] == [1]


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_engine_hangs_at_changing_steps_reach_none_and_a_push_hang_keeps_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A fresh run keeps vLLM's own CUDA graphs; its engine wedges at step 1 (exit 75): the restart resumes with a
    PIECEWISE engine and Triton prefill, which wedges at step 2, another step: the next restart's engine is NONE (it
    was PIECEWISE: only a hang repeated at one step raised the level). That run's weight push then never returns (a
    hang elsewhere than the engine): the level stays REPEATED_HANG."""
    out = tmp_path / "out"
    first = single(tiny_model_dir, tmp_path, {"WEDGE_STEP": "1"})
    assert first.returncode == 75, first.stderr[-3000:]
    assert engine_arguments(tmp_path, 0) == (None, TRITON) and built_mode(tmp_path, 0) == "FULL_AND_PIECEWISE"
    assert state(out)["level"] == "ENGINE_HANG"

    again = single(tiny_model_dir, tmp_path, {"WEDGE_STEP": "2", "WEDGE_TIMES": "2"})  # resumes at 1, wedges at 2
    assert again.returncode == 75, again.stderr[-3000:]
    assert engine_arguments(tmp_path, 1) == ({"cudagraph_mode": "PIECEWISE"}, TRITON)
    assert built_mode(tmp_path, 1) == "PIECEWISE"
    assert [(h["step"], h["kind"]) for h in state(out)["hangs"]] == [(1, "engine-step"), (2, "engine-step")]
    assert state(out)["level"] == "REPEATED_HANG"

    push = single(tiny_model_dir, tmp_path, {"HANG_PUSH": "1", "WEDGE_TIMES": "0"})  # resumes at 2; 2nd push hangs
    assert push.returncode == 75, push.stderr[-3000:]
    assert engine_arguments(tmp_path, 2) == ({"cudagraph_mode": "NONE"}, "triton") and built_mode(tmp_path, 2) == "NONE"
    assert state(out)["hangs"][-1]["kind"] == "sync_weights" and state(out)["level"] == "REPEATED_HANG"
    # A start after these, with the fast settings pinned, still builds NONE and Triton (a pin is the least protection,
    # never the most): tests/test_cudagraph.py::test_the_engine_gets_the_protection_its_output_dir_asks_for (every
    # pinned mode against every level), tests/test_gdn_prefill.py::
    # test_a_selected_flashinfer_prefill_gives_way_to_triton_after_an_engine_hang, and the trainer-start line of a
    # protected start,
    # tests/test_cudagraph.py::test_a_trainer_built_after_a_hang_says_which_mode_and_why (a fourth process here was
    # removed for CI's time).


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_the_protection_survives_a_crash_after_the_protected_restart(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Hang (75) -> the restart resumes with a PIECEWISE engine and dies in its first rollout (a crash, a
    preemption) -> the next start still builds PIECEWISE (before, the reports were used up at the restart's training
    start: vLLM's own graphs again, the same batch, the same hang). It does not resume: the report was used."""
    first = single(tiny_model_dir, tmp_path, {"WEDGE_STEP": "2"})
    assert first.returncode == 75, first.stderr[-3000:]
    for attempt, step in ((1, 2), (2, 0)):  # the restart resumes at step 2; the later start does not resume
        result = single(tiny_model_dir, tmp_path, {"CRASH_AT_GENERATE": "1"})
        assert result.returncode == 1 and "CRASH_AT_GENERATE" in result.stderr, result.stderr[-3000:]
        assert first_rollout(attempts(tmp_path / "records", 0)[attempt])["step"] == step
        assert engine_arguments(tmp_path, attempt) == ({"cudagraph_mode": "PIECEWISE"}, TRITON), attempt
    assert (tmp_path / "out" / "trl_vlm_fixes_hang_rank0.resumed.txt").exists()


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_an_unreadable_state_warns_and_protects_in_a_real_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A state cut short (a full disk, a copy interrupted): the start warns, naming the file and the protected level,
    and builds PIECEWISE (before: nothing said, vLLM's own graphs)."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / STATE).write_text('{"level": "ENGINE_HANG", "hangs": [{"st')
    result = single(tiny_model_dir, tmp_path, {"BUILD_ONLY": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"the protection state {tmp_path / 'out' / STATE} cannot be read (" in result.stderr
    assert "the engine is built with the protected level ENGINE_HANG (cudagraph mode=PIECEWISE" in result.stderr
    assert engine_arguments(tmp_path, 0) == ({"cudagraph_mode": "PIECEWISE"}, TRITON)


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_node_local_output_dirs_keep_their_own_state_and_a_tensor_parallel_pair_that_differs_stops_at_build(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Each rank writes into a directory of its own (node-local output_dir, save_on_each_node=True), the two ranks
    one vLLM tensor-parallel pair: rank 1's engine wedges; only its directory records the hang. In the restart the pair
    would build different engines (rank 1 PIECEWISE, rank 0 vLLM's graphs: on a GPU they would wait on each other in
    graph capture): both stop at build with a clear error, before any engine is built (before: no error)."""
    env = {"NODE_LOCAL": "1", "TP": "2", "WEDGE_STEP": "1", "MAX_STEPS": "2"}
    result, out, records = run_ranks(tiny_model_dir, tmp_path, env)
    assert "failed (exitcode: 75) local_rank: 1" in result.stderr and result.returncode == 1, result.stderr[-4000:]
    assert state(out / "rank1")["level"] == "ENGINE_HANG" and not (out / "rank0" / STATE).exists()
    assert result.stderr.count("the ranks of one vLLM tensor-parallel group would build different engines") >= 2
    assert "rank 0: cudagraph mode=auto" in result.stderr and "rank 1: cudagraph mode=PIECEWISE" in result.stderr
    for rank in (0, 1):
        assert len(attempts(records, rank)) == 1  # the restart recorded no engine: it stopped before the build


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
@pytest.mark.parametrize("ending", ["hang, cudagraph off", "crash"])
def test_no_escalation_upstream_nor_after_a_run_that_did_not_hang(
    tiny_model_dir: Path, tmp_path: Path, ending: str
) -> None:
    """With the fix off (``TRL_VLM_FIXES_CUDAGRAPH=0``) the restart after an engine hang is exactly upstream: no
    compilation_config, the same graphs again. With it on, a run that ended any other way than an engine hang (here
    an exception in its rollout) leaves no report: the next start keeps vLLM's own mode."""
    off = {"TRL_VLM_FIXES_CUDAGRAPH": "0"} if ending.endswith("off") else {}
    if ending == "crash":
        first = single(tiny_model_dir, tmp_path, {"CRASH_AT_GENERATE": "1"})
        assert first.returncode == 1 and not list((tmp_path / "out").glob("trl_vlm_fixes_hang_rank*"))
    else:
        first = single(tiny_model_dir, tmp_path, {**off, "WEDGE_TIMES": "1"})
        assert first.returncode == 75 and (tmp_path / "out" / "trl_vlm_fixes_hang_rank0.txt").exists()
    restart = single(tiny_model_dir, tmp_path, {**off, "BUILD_ONLY": "1"})
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert engine_arguments(tmp_path, 1)[0] is None and built_mode(tmp_path, 1) == "FULL_AND_PIECEWISE"


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_a_slow_checkpoint_save_under_tensor_parallelism_never_ends_the_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """vllm_tensor_parallel_size=2 on two gloo ranks (TRL's colocate TP path: its prompt gather across the pair, the
    stand-in as the engine), a checkpoint every step, rank 0's first save 30 s long (mid-save, after the weights):
    rank 1 waits for it in TRL's gather and the run goes on (a 10 s limit used to end rank 1 and cut rank 0's save)."""
    from trl_vlm_fixes.patches.watchdog.checkpoints import missing

    env = {"MAX_STEPS": "2", "TP": "2", "SLOW_SAVE_SECONDS": "30", "SLOW_SAVE_STEPS": "1", "WEDGE_TIMES": "0"}
    result, out, records = run_ranks(tiny_model_dir, tmp_path, env, restarts=0)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not list(out.glob("trl_vlm_fixes_hang_rank*")) and "exitcode" not in result.stderr
    ((rank0,), (rank1,)) = attempts(records, 0), attempts(records, 1)
    assert rank0[-1]["steps"] == rank1[-1]["steps"] == 2
    saved = next(e["at"] for e in rank0 if e["event"] == "saved" and e["step"] == 1)
    entered = [e["entered"] for e in rank1 if e["event"] == "generate"]
    assert entered[1] >= saved - 1 and entered[1] - entered[0] > 30  # rank 1 waited out the save in the TP gather
    for step in (1, 2):
        assert missing(out / f"checkpoint-{step}", world_size=2, deepspeed=False) == []


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_a_slow_first_weight_push_passes_in_every_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The first weight push of each process takes 12 s, above the 10 s floor: a first call may take 10 x the floor,
    so neither the first run nor a second one in that output_dir is ended (nor a "repeated hang" made of them); the
    learned limit is kept in output_dir."""
    slow = {"SLOW_PUSH_SECONDS": "12", "MAX_STEPS": "2", "WEDGE_TIMES": "0"}
    for run in range(2):
        result = single(tiny_model_dir, tmp_path, slow)
        assert result.returncode == 0, result.stderr[-3000:]
        assert attempts(tmp_path / "records", 0)[run][-1]["steps"] == 2
        assert engine_arguments(tmp_path, run)[0] is None  # never escalated: vLLM's own mode in every run
    assert not list((tmp_path / "out").glob("trl_vlm_fixes_hang_rank*"))
    learned = json.loads((tmp_path / "out" / "trl_vlm_fixes_watchdog_limits_rank0.json").read_text())
    assert learned["sync_weights"] >= 12


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_a_checkpoint_that_cannot_resume_is_not_resumed_into(tiny_model_dir: Path, tmp_path: Path) -> None:
    """save_only_model=True: the checkpoints hold no optimizer, scheduler or RNG state, which transformers would skip
    without a word. The restart says so in one line and starts at step 0 as upstream does; the report is used."""
    from trl_vlm_fixes.patches.watchdog.resume import unused_reports

    first = single(tiny_model_dir, tmp_path, {"SAVE_ONLY_MODEL": "1", "WEDGE_STEP": "2"})
    assert first.returncode == 75, first.stderr[-3000:]
    restart = single(tiny_model_dir, tmp_path, {"SAVE_ONLY_MODEL": "1", "CRASH_AT_GENERATE": "1"})
    assert restart.returncode == 1 and "CRASH_AT_GENERATE" in restart.stderr, restart.stderr[-3000:]
    lacks = "checkpoint-2 lacks optimizer.pt, scheduler.pt, rng_state.pth (save_only_model=True saves the weights only)"
    line = f"no checkpoint can resume ({lacks}): starting from step 0"
    assert restart.stderr.count(line) == 1, restart.stderr[-3000:]
    assert first_rollout(attempts(tmp_path / "records", 0)[1])["step"] == 0
    assert unused_reports(tmp_path / "out") == {}


def test_resume_from_checkpoint_in_the_arguments_and_the_first_rollout_after_it(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, reapply: Any, one_fix_off: Any
) -> None:
    """``resume_from_checkpoint`` in the training arguments (a config file, ``--resume_from_checkpoint``) is ignored
    upstream (train() starts from step 0); with the fix it resumes. Colocate + sleep mode: the first rollout after the
    resume runs on the resumed weights, on the base checkpoint without reload_skip."""
    import trl.generation.vllm_generation as vllm_generation

    import trl_vlm_fixes
    from trl_vlm_fixes.selftest.engine_standin import StandInLLM, engine_weights_match, trainer_weights

    rollouts: list[dict[str, Any]] = []
    holder: dict[str, Any] = {}

    class RecordingEngine(StandInLLM):
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            out = super().generate(*args, **kwargs)
            trainer = holder["trainer"]
            rollouts.append(
                {
                    "step": trainer.state.global_step,
                    "on_trainer": engine_weights_match(self.rollouts[-1], trainer_weights(trainer.model)),
                    "on_base": engine_weights_match(self.rollouts[-1], self.checkpoint),
                }
            )
            return out

    monkeypatch.setattr(vllm_generation, "LLM", RecordingEngine, raising=False)
    settings = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": True, "learning_rate": 0.05}

    def train(max_steps: int, **extra: Any) -> dict[str, Any]:
        rollouts.clear()
        holder["trainer"] = trainer = make_trainer("grpo", max_steps=max_steps, **settings, **extra)
        trainer.train()
        return rollouts[0]

    train(2, save_strategy="steps", save_steps=1)
    checkpoint = str(Path(holder["trainer"].args.output_dir) / "checkpoint-2")
    monkeypatch.setenv("TRL_VLM_FIXES_WATCHDOG_RESUME", "0")
    reapply()  # read at apply()
    assert train(3, resume_from_checkpoint=checkpoint)["step"] == 0  # upstream: the field is ignored
    monkeypatch.delenv("TRL_VLM_FIXES_WATCHDOG_RESUME")
    one_fix_off("reload_skip")
    stale = upstream_reloads_from_disk()  # TRL 1.9.1 reloads the disk checkpoint; 1.16 re-pushes the weights itself
    assert train(3, resume_from_checkpoint=checkpoint) == {"step": 2, "on_trainer": not stale, "on_base": stale}
    monkeypatch.delenv("TRL_VLM_FIXES_RELOAD_SKIP")
    trl_vlm_fixes.revert()
    trl_vlm_fixes.apply()
    assert train(3, resume_from_checkpoint=checkpoint) == {"step": 2, "on_trainer": True, "on_base": False}
    assert holder["trainer"].state.global_step == 3


STAND_IN_SITE = '''
import json, os, time
import wrapt


def _install(module):
    from trl_vlm_fixes.selftest.engine_standin import StandInLLM, engine_weights_match, read_checkpoint

    records, checkpoint = os.environ["RESUME_RECORDS"], os.path.join(os.environ["RESUME_OUT"], "checkpoint-3")

    class WedgingEngine(StandInLLM):
        """The 4th rollout (step 3) of the first attempt never returns; every rollout is recorded."""

        calls = 0

        def generate(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 4 and not os.path.exists(os.path.join(records, "wedged")):
                open(os.path.join(records, "wedged"), "w").close()
                while True:
                    time.sleep(3600)
            out = super().generate(*args, **kwargs)
            rollout = self.rollouts[-1]
            entry = {"pid": os.getpid(), "on_base": engine_weights_match(rollout, self.checkpoint),
                     "on_checkpoint_3": os.path.isdir(checkpoint)
                     and engine_weights_match(rollout, read_checkpoint(checkpoint))}
            with open(os.path.join(records, "rollouts.jsonl"), "a") as handle:
                handle.write(json.dumps(entry) + "\\n")
            return out

    module.LLM = WedgingEngine


wrapt.register_post_import_hook(_install, "trl.generation.vllm_generation")
'''
# a user's restart loop (one restart here), saying what exit status it saw: `trl grpo` runs the script through
# `accelerate launch`, which exits 1 and names the script's 75 in its CalledProcessError
RESTART_LOOP = (
    'tries=0; until "$@"; do status=$?; tries=$((tries + 1)); [ "$tries" -ge 2 ] && exit 1; '
    'echo "restart after exit $status" >&2; done'
)


def run_cli_with_restarts(model_dir: Path, base: Path, env: dict[str, str]) -> tuple[Any, list[list[dict[str, Any]]]]:
    """``until trl-vlm-fixes run -- trl grpo --config ...; do ...; done`` (2 tries), the engine stand-in injected
    through a user sitecustomize (the launcher keeps it)."""
    from test_launcher import launcher, run

    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, mixed_dataset

    site, data, records, out = base / "site", base / "data", base / "records", base / "out"
    for folder in (site, data, records):
        folder.mkdir()
    (site / "sitecustomize.py").write_text(STAND_IN_SITE)
    mixed_dataset(MIXED_SAMPLES).to_parquet(str(data / "train.parquet"))
    (base / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [float(len(str(c))) for c in completions]\n"
    )
    config = base / "grpo.yaml"
    config.write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {data}\nreward_funcs: [my_rewards.length_reward]\n"
        f"output_dir: {out}\nper_device_train_batch_size: 4\nnum_generations: 2\nmax_completion_length: 8\n"
        "max_steps: 4\nlogging_steps: 1\nreport_to: none\nuse_cpu: true\nbf16: false\nseed: 0\ndtype: float32\n"
        "learning_rate: 0.05\nsave_strategy: steps\nsave_steps: 1\nuse_vllm: true\nvllm_mode: colocate\n"
        "vllm_enable_sleep_mode: true\n"
    )
    trl = str(Path(sys.executable).parent / "trl")
    command = ["bash", "-c", RESTART_LOOP, "loop", *launcher(), "run", "--", trl, "grpo", "--config", str(config)]
    environment = {
        "PYTHONPATH": str(site),
        "RESUME_RECORDS": str(records),
        "RESUME_OUT": str(out),
        "TRL_VLM_FIXES_WATCHDOG": LIMIT,
        **env,
    }
    started = time.monotonic()
    result = run(command, env=environment, cwd=base, timeout=500)
    print(f"trl grpo under the launcher, one hang and one restart: {time.monotonic() - started:.0f} s")
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for line in (records / "rollouts.jsonl").read_text().splitlines():
        entry = json.loads(line)
        by_pid.setdefault(entry["pid"], []).append(entry)
    return result, list(by_pid.values())


# validated stack only (CI time): its decision (protection state, resume choice) is the plugin's own; on the newest
# stack TRL's restart-and-resume runs in test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights
@pytest.mark.stack_independent
@pytest.mark.slow
def test_trl_cli_restarted_by_a_shell_loop_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """TRL's own `trl grpo` never passes resume_from_checkpoint: upstream the restart trains from step 0 on the base
    model; with the fix it resumes from checkpoint-3 and its first rollout runs on those weights."""
    (tmp_path / "off").mkdir()
    upstream, (_, restarted) = run_cli_with_restarts(tiny_model_dir, tmp_path / "off", OFF)
    assert upstream.returncode == 0 and upstream.stderr.count("restart after exit 1\n") == 1, upstream.stderr[-3000:]
    assert "returned non-zero exit status 75." in upstream.stderr  # accelerate's CalledProcessError, the script's 75
    assert len(restarted) == 4 and restarted[0]["on_base"]  # 4 steps again, from the base model

    (tmp_path / "on").mkdir()
    fixed, (_, resumed) = run_cli_with_restarts(tiny_model_dir, tmp_path / "on", {})
    assert fixed.returncode == 0 and fixed.stderr.count("restart after exit 1\n") == 1, fixed.stderr[-3000:]
    assert "returned non-zero exit status 75." in fixed.stderr
    assert "resuming from" in fixed.stderr and "checkpoint-3" in fixed.stderr
    assert resumed == [{"pid": resumed[0]["pid"], "on_base": False, "on_checkpoint_3": True}]  # step 3 only


@pytest.mark.stack_independent
def test_only_a_checkpoint_that_can_resume_is_resumed_into(tmp_path: Path) -> None:
    """Trainer state, optimizer, scheduler and the RNG state of every rank, as the run saves them; a save cut short
    (no trainer_state.json, or one rank's RNG state missing) and a save_only_model checkpoint are passed over."""
    from trl_vlm_fixes.patches.watchdog.checkpoints import last_resumable, missing

    full = ["trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"]
    for step, files in (
        (2, full),
        (3, [name for name in full if name != "rng_state_1.pth"]),  # rank 1 died before its RNG state
        (4, ["optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"]),  # rank 0 cut short
    ):
        (tmp_path / f"checkpoint-{step}").mkdir()
        for name in files:
            (tmp_path / f"checkpoint-{step}" / name).write_text("")
    assert last_resumable(str(tmp_path), 2, deepspeed=False) == (str(tmp_path / "checkpoint-2"), "")
    assert missing(tmp_path / "checkpoint-3", 2, deepspeed=False) == ["rng_state_1.pth"]
    assert missing(tmp_path / "checkpoint-2", 1, deepspeed=False) == ["rng_state.pth"]  # another world size
    assert missing(tmp_path / "checkpoint-2", 2, deepspeed=True) == ["global_step*/ (DeepSpeed state)"]
    only_model = tmp_path / "only_model" / "checkpoint-5"
    only_model.mkdir(parents=True)
    (only_model / "trainer_state.json").write_text("")
    assert last_resumable(str(tmp_path / "only_model"), 1, deepspeed=False) == (
        None,
        "checkpoint-5 lacks optimizer.pt, scheduler.pt, rng_state.pth",
    )
    assert last_resumable(str(tmp_path / "none"), 1, deepspeed=False) == (None, "no checkpoint in it yet")
