"""watchdog/resume: a restart after a watchdog exit resumes from the last checkpoint on the resumed weights, and a hang
repeated at one step is named and followed by an engine with the protected settings.

Upstream (``TRL_VLM_FIXES_WATCHDOG_RESUME=0``, or the fixes reverted) a restarted job starts again from step 0:
``trl grpo`` calls ``train()`` with no checkpoint and transformers ignores the field of the training arguments.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import environment_without_switches, upstream_reloads_from_disk

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


def run_program(command: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    environment = {**environment_without_switches(), "HF_HUB_OFFLINE": "1", "TRL_VLM_FIXES_WATCHDOG": LIMIT, **env}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)


def run_ranks(model_dir: Path, base: Path, env: dict[str, str]) -> tuple[Any, Path, Path]:
    """resume_ranks.py under ``torchrun --max-restarts 1`` (2 CPU ranks, gloo): rank 1 wedges once at step 3.

    ``--standalone`` (c10d rendezvous): each restart round gets fresh rendezvous keys, so a restarted gloo group never
    reads the dead round's addresses."""
    out, records = base / "out", base / "records"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "1",
        str(PROGRAM),
        str(model_dir),
        str(out),
        str(records),
    ]
    started = time.monotonic()
    result = run_program(command, {"MAX_STEPS": "4", "WEDGE_RANK": "1", "WEDGE_STEP": "3", **env}, timeout=300)
    print(f"torchrun, 2 ranks, one hang and one restart: {time.monotonic() - started:.0f} s")
    return result, out, records


@pytest.mark.slow
def test_torchrun_restart_after_a_hang_starts_from_step_0_upstream(tiny_model_dir: Path, tmp_path: Path) -> None:
    result, out, records = run_ranks(tiny_model_dir, tmp_path, OFF)
    assert "exitcode: 75" in result.stderr and result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        _, restarted = attempts(records, rank)
        assert first_rollout(restarted)["step"] == 0 and first_rollout(restarted)["on_base"]  # from scratch
        assert restarted[-1] == {"event": "end", "pid": restarted[0]["pid"], "steps": 4}
    assert (out / "trl_vlm_fixes_hang_rank1.txt").exists()  # nobody resumed after it


@pytest.mark.slow
def test_torchrun_restart_after_a_hang_resumes_on_the_resumed_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 1's generate wedges at step 3: the watchdog ends it (75), torchrun ends rank 0 and restarts both; both
    resume from checkpoint-3 (rank 0 wrote no report: it reads rank 1's), the first rollout runs on the resumed
    weights on both ranks, training ends at exactly max_steps, and the report is marked as used."""
    from trl_vlm_fixes.patches.watchdog.resume import unused_reports

    result, out, records = run_ranks(tiny_model_dir, tmp_path, {})
    assert "exitcode: 75" in result.stderr and result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count("ended by the rollout watchdog (hang at step 3") == 1  # one line, from rank 0
    assert f"resuming from {out / 'checkpoint-3'}" in result.stderr
    for rank in (0, 1):
        hung, resumed = attempts(records, rank)
        assert [e["step"] for e in hung if e["event"] == "generate"][:3] == [0, 1, 2]
        assert not any(e["event"] == "end" for e in hung)
        assert [e["step"] for e in resumed if e["event"] == "generate"] == [3]
        assert first_rollout(resumed)["on_trainer"] and not first_rollout(resumed)["on_base"]
        assert resumed[-1] == {"event": "end", "pid": resumed[0]["pid"], "steps": 4}
    assert unused_reports(out) == {} and (out / "trl_vlm_fixes_hang_rank1.resumed.txt").exists()


def single(model_dir: Path, out: Path, records: Path, env: dict[str, str]) -> Any:
    """One process of resume_ranks.py (rank 0 wedges at step 3, WEDGE_TIMES times over all runs)."""
    command = [sys.executable, str(PROGRAM), str(model_dir), str(out), str(records)]
    return run_program(command, {"MAX_STEPS": "4", "WEDGE_RANK": "0", "WEDGE_STEP": "3", "WEDGE_TIMES": "2", **env})


@pytest.mark.slow
def test_a_hang_repeated_at_one_step_is_named_and_the_restart_is_protected(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The same batch replayed hangs again: with the fix, the report says so and the restart after it builds the
    engine with the protected settings (one log line); upstream the restart replays from step 0 and nothing is named."""
    from trl_vlm_fixes.patches.watchdog.resume import REPEATED, protected_after_repeated_hang

    first = single(tiny_model_dir, tmp_path / "on" / "out", tmp_path / "on" / "records", {})
    assert first.returncode == 75, first.stderr[-3000:]
    shutil.copytree(tmp_path / "on", tmp_path / "off")  # the same first hang, restarted both ways

    upstream = single(tiny_model_dir, tmp_path / "off" / "out", tmp_path / "off" / "records", OFF)
    assert upstream.returncode == 75, upstream.stderr[-3000:]
    assert first_rollout(attempts(tmp_path / "off" / "records", 0)[1])["step"] == 0  # replayed from step 0
    assert REPEATED not in (tmp_path / "off" / "out" / "trl_vlm_fixes_hang_rank0.txt").read_text()
    assert not protected_after_repeated_hang(tmp_path / "off" / "out")

    again = single(tiny_model_dir, tmp_path / "on" / "out", tmp_path / "on" / "records", {})
    assert again.returncode == 75, again.stderr[-3000:]
    assert [e["step"] for e in attempts(tmp_path / "on" / "records", 0)[1] if e["event"] == "generate"] == []
    report = (tmp_path / "on" / "out" / "trl_vlm_fixes_hang_rank0.txt").read_text()
    assert "at step 3." in report.splitlines()[0] and f"{REPEATED} the run restarted after a hang at step 3" in report

    fast = {"BUILD_ONLY": "1", "TRL_VLM_FIXES_CUDAGRAPH_MODE": "FULL_AND_PIECEWISE"}
    restart = single(tiny_model_dir, tmp_path / "on" / "out", tmp_path / "on" / "records", fast)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert attempts(tmp_path / "on" / "records", 0)[2][0]["protected"] is True
    assert restart.stderr.count("hung twice at step 3") == 1
    assert "protected settings (cudagraph_mode=FULL_AND_PIECEWISE -> NONE)" in restart.stderr


def test_resume_from_checkpoint_in_the_arguments_and_the_first_rollout_after_it(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, one_fix_off: Any
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
RESTART_LOOP = 'tries=0; until "$@"; do tries=$((tries + 1)); [ "$tries" -ge 2 ] && exit 1; echo restart >&2; done'


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


@pytest.mark.slow
def test_trl_cli_restarted_by_a_shell_loop_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    """TRL's own `trl grpo` never passes resume_from_checkpoint: upstream the restart trains from step 0 on the base
    model; with the fix it resumes from checkpoint-3 and its first rollout runs on those weights."""
    (tmp_path / "off").mkdir()
    upstream, (_, restarted) = run_cli_with_restarts(tiny_model_dir, tmp_path / "off", OFF)
    assert upstream.returncode == 0 and upstream.stderr.count("restart\n") == 1, upstream.stderr[-3000:]
    assert len(restarted) == 4 and restarted[0]["on_base"]  # 4 steps again, from the base model

    (tmp_path / "on").mkdir()
    fixed, (_, resumed) = run_cli_with_restarts(tiny_model_dir, tmp_path / "on", {})
    assert fixed.returncode == 0 and fixed.stderr.count("restart\n") == 1, fixed.stderr[-3000:]
    assert "resuming from" in fixed.stderr and "checkpoint-3" in fixed.stderr
    assert resumed == [{"pid": resumed[0]["pid"], "on_base": False, "on_checkpoint_3": True}]  # step 3 only


def test_resume_passes_over_a_checkpoint_cut_short(tmp_path: Path) -> None:
    """A save ended by the process's end has no trainer_state.json (transformers writes it last): not resumed into."""
    from trl_vlm_fixes.patches.watchdog.resume import last_complete_checkpoint

    for step, complete in ((2, True), (3, True), (4, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")
    assert last_complete_checkpoint(str(tmp_path / "checkpoint-4")) is None
