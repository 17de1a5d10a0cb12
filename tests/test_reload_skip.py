"""reload_skip: TRL's real VLLMGeneration driven on the behavioural engine stand-in (no vLLM engine runs on CPU)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from stack import upstream_reloads_from_disk

import trl_vlm_fixes
from trl_vlm_fixes.engine_standin import StandInLLM, engine_weights_match, trainer_weights
from trl_vlm_fixes.rollout_schedule import TrainerLoop, run_schedule

bug_present = pytest.mark.skipif(
    not upstream_reloads_from_disk(), reason="this TRL re-pushes discarded weights itself: no reload bug to show"
)


@bug_present
def test_upstream_rollouts_run_on_the_base_model(make_generation: Callable[..., Any], fixes_off: None) -> None:
    loop = TrainerLoop(make_generation())
    run_schedule(loop)
    assert loop.engine.disk_reloads == loop.generates
    assert loop.stale == loop.generates - 1  # only step 0 (base model == trainer) was right
    assert loop.on_checkpoint == loop.stale  # every stale rollout ran on the original checkpoint


@bug_present
def test_skipping_the_reload_alone_gives_garbage(
    make_generation: Callable[..., Any], fixes_off: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the fix re-pushes: without reload and without a push, level-2 sleep leaves all-zero weights."""
    loop = TrainerLoop(make_generation())
    monkeypatch.setattr(loop.engine, "collective_rpc", lambda *a, **k: [None])
    run_schedule(loop)
    assert loop.on_zeros >= 3


def test_rollouts_run_on_current_weights_with_fix(make_generation: Callable[..., Any]) -> None:
    loop = TrainerLoop(make_generation())
    run_schedule(loop)
    assert loop.stale == 0
    assert loop.engine.disk_reloads == 0
    assert loop.max_full_pushes_per_generate <= 1.0
    if upstream_reloads_from_disk():
        state = trl_vlm_fixes.patches.reload_skip.engine_weights(loop.generation)
        assert state.repushes == 3 and state.reloads_skipped == loop.generates


@pytest.mark.skipif(upstream_reloads_from_disk(), reason="TRL 1.9.1 has the bug (shown above)")
def test_newer_trl_needs_no_fix_and_the_fix_says_so(make_generation: Callable[..., Any], fixes_off: None) -> None:
    loop = TrainerLoop(make_generation())
    run_schedule(loop)
    assert loop.stale == 0 and loop.engine.disk_reloads == 0
    trl_vlm_fixes.apply()
    report = trl_vlm_fixes.status()["patches"]["reload_skip"]
    assert report["state"] == "not-needed" and "re-pushes" in report["detail"]


def test_backend_without_reload_weights_still_gets_current_weights(make_generation: Callable[..., Any]) -> None:
    class NoReloadBackend(StandInLLM):
        def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> list[Any]:
            raise NotImplementedError(method)

    loop = TrainerLoop(make_generation(engine_class=NoReloadBackend))
    run_schedule(loop)
    assert loop.stale == 0


def test_colocate_without_sleep_is_untouched(make_generation: Callable[..., Any]) -> None:
    loop = TrainerLoop(make_generation(enable_sleep_mode=False))
    run_schedule(loop)
    assert loop.engine.sleeps == [] and loop.engine.disk_reloads == 0
    assert loop.engine.tensor_pushes == 3 * sum(1 for _ in loop.model.parameters())  # TRL's own 3 syncs, no more
    assert loop.generation not in trl_vlm_fixes.patches.reload_skip._engines


def test_server_mode_is_untouched() -> None:
    from trl_vlm_fixes.patches.reload_skip import generate_wrapper

    class ServerGeneration:
        mode = "server"
        enable_sleep_mode = True

    calls: list[str] = []
    assert generate_wrapper(lambda: calls.append("generate") or "out", ServerGeneration(), (), {}) == "out"
    assert calls == ["generate"]


class WeightSchedules(RuleBasedStateMachine):
    """Random schedules of optimizer steps, syncs, rollouts, repeated rollouts in one step and evaluation."""

    build: Callable[..., Any]

    @initialize()
    def start(self) -> None:
        self.loop = TrainerLoop(self.build())

    @rule()
    def optimizer_step(self) -> None:
        self.loop.optimizer_step()

    @rule()
    def sync(self) -> None:
        self.loop.sync()

    @rule()
    def trl_generate(self) -> None:
        self.loop.trl_generate()

    @rule(times=st.integers(1, 3))
    def several_generates_in_one_step(self, times: int) -> None:
        for _ in range(times):
            self.loop.generate_again()

    @rule()
    def evaluate(self) -> None:
        self.loop.model.eval()
        self.loop.trl_generate()
        self.loop.model.train()

    @invariant()
    def every_rollout_on_current_weights(self) -> None:
        if hasattr(self, "loop"):
            assert self.loop.stale == 0, "a rollout ran on stale or discarded weights"
            assert self.loop.engine.disk_reloads == 0, "the checkpoint was reloaded from disk"
            assert self.loop.max_full_pushes_per_generate <= 1.0, "more than one full push for one generate"


SCHEDULE_SETTINGS = settings(
    max_examples=20,
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    report_multiple_bugs=False,
)


def _machine(build: Callable[..., Any]) -> type[WeightSchedules]:
    return type("Schedules", (WeightSchedules,), {"build": staticmethod(build)})


def test_random_schedules_with_fix(make_generation: Callable[..., Any]) -> None:
    run_state_machine_as_test(_machine(make_generation), settings=SCHEDULE_SETTINGS)


@bug_present
def test_random_schedules_find_the_bug_upstream(make_generation: Callable[..., Any], fixes_off: None) -> None:
    with pytest.raises(AssertionError, match=r"stale or discarded|reloaded from disk"):
        run_state_machine_as_test(_machine(make_generation), settings=SCHEDULE_SETTINGS)


def colocate_sleep_trainer(make_trainer: Any) -> Any:
    """GRPO with use_vllm, colocate, sleep mode, 4 mixed prompts and two rollouts per optimizer step
    (gradient_accumulation_steps=2 > steps_per_generation=1), for 3 steps."""
    from trl_vlm_fixes.demo import MIXED_SAMPLES, mixed_dataset

    return make_trainer(
        "grpo",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        gradient_accumulation_steps=2,
        steps_per_generation=1,
        max_steps=3,
        learning_rate=0.05,
        generation_kwargs=None,
        dataset=mixed_dataset(MIXED_SAMPLES),
    )


def test_grpo_colocate_sleep_mode_end_to_end(make_trainer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPOTrainer with use_vllm, colocate, sleep mode, the mixed image batch, and 2 generations per optimizer step."""
    import trl.generation.vllm_generation as vllm_generation

    records: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    trainer_holder: dict[str, Any] = {}

    class RecordingEngine(StandInLLM):
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            out = super().generate(*args, **kwargs)
            records.append((self.rollouts[-1], trainer_weights(trainer_holder["trainer"].model)))
            return out

    monkeypatch.setattr(vllm_generation, "LLM", RecordingEngine, raising=False)
    trainer = colocate_sleep_trainer(make_trainer)
    trainer_holder["trainer"] = trainer
    trainer.train()
    engine = trainer.vllm_generation.llm
    assert trainer.state.global_step == 3 and len(records) == 6
    assert all(engine_weights_match(engine_state, current) for engine_state, current in records)
    assert not engine_weights_match(engine.checkpoint, records[-1][1]), "training never moved the weights"
    assert engine.disk_reloads == 0
    assert engine.init_kwargs["compilation_config"] == {"cudagraph_mode": "NONE"}
    if upstream_reloads_from_disk():
        logged = [log for log in trainer.state.log_history if "trl_vlm_fixes/weight_repushes" in log]
        assert logged and all(log["trl_vlm_fixes/disk_reloads_skipped"] >= 1 for log in logged)


@bug_present
def test_grpo_colocate_sleep_mode_end_to_end_upstream_is_stale(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch, one_fix_off: Callable[[str], None]
) -> None:
    import trl.generation.vllm_generation as vllm_generation

    one_fix_off("reload_skip")
    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    trainer = colocate_sleep_trainer(make_trainer)
    trainer.train()
    engine = trainer.vllm_generation.llm
    assert engine.disk_reloads == 6
    assert sum(engine_weights_match(rollout, engine.checkpoint) for rollout in engine.rollouts) == 6
    assert not engine_weights_match(engine.checkpoint, trainer_weights(trainer.model)), "the weights never moved"


def test_stand_in_matches_the_real_vllm_signatures() -> None:
    vllm = pytest.importorskip("vllm")
    for method in ("sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "generate"):
        real = inspect.signature(getattr(vllm.LLM, method)).parameters
        ours = inspect.signature(getattr(StandInLLM, method)).parameters
        assert list(ours) == list(real), method
        for name, parameter in ours.items():
            assert parameter.kind == real[name].kind, (method, name)
            if real[name].default is not inspect.Parameter.empty:
                assert parameter.default == real[name].default, (method, name)
    init = inspect.signature(vllm.LLM.__init__).parameters
    assert ("model" in init and "enable_sleep_mode" in inspect.signature(vllm.LLM.__init__).parameters) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in init.values()
    )
