"""reload_skip: TRL's real VLLMGeneration driven on the behavioural engine stand-in (no vLLM engine runs on CPU)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import QWEN_FAMILIES, upstream_reloads_from_disk
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import trl_vlm_fixes
from trl_vlm_fixes.selftest.engine_standin import StandInLLM, engine_weights_match, trainer_weights
from trl_vlm_fixes.selftest.rollout_schedule import TrainerLoop, run_schedule

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


class PushAudit(StandInLLM):
    """Counts redundant pushes: pushes before a generate that only wrote values the engine already held."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.redundant_pushes = 0
        self._already_held: list[bool] = []  # per tensor loaded since the last generate
        loader = self.llm_engine.model_executor.driver_worker.model_runner.model
        load = loader.load_weights

        def audited(weights: Any) -> Any:
            weights = list(weights)
            self._already_held += [n in self.weights and torch.equal(self.weights[n], t.cpu()) for n, t in weights]
            return load(weights)

        loader.load_weights = audited

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.redundant_pushes += bool(self._already_held) and all(self._already_held)
        self._already_held = []
        return super().generate(*args, **kwargs)


def schedule_steps(loop: TrainerLoop) -> list[Callable[[], None]]:
    """run_schedule's steps, one by one, so that the engine can be checked between them."""
    return [
        loop.trl_generate,
        loop.optimizer_step,
        loop.trl_generate,
        loop.trl_generate,
        lambda: loop.tool_rollout(turns=3),
        loop.generate_again,
        loop.optimizer_step,
        loop.trl_generate,
        loop.trl_generate,
    ]


@bug_present
@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_every_family_runs_on_the_base_model_upstream_and_on_current_weights_with_fix(
    family_model_dir: Callable[[str], Any], one_fix_off: Callable[[str], None], family: str
) -> None:
    """Every Qwen family, dense and MoE (experts included in what each rollout runs on)."""
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.rollout_schedule import build_generation

    model_dir = family_model_dir(family)
    processor = AutoProcessor.from_pretrained(model_dir)
    fixed = TrainerLoop(build_generation(model_dir, processor))
    run_schedule(fixed)
    assert fixed.stale == 0 and fixed.engine.disk_reloads == 0
    one_fix_off("reload_skip")
    upstream = TrainerLoop(build_generation(model_dir, processor))
    run_schedule(upstream)
    assert upstream.stale == upstream.generates - 1 and upstream.on_checkpoint == upstream.stale


def test_rollouts_run_on_current_weights_with_fix(make_generation: Callable[..., Any]) -> None:
    """Every generate on the trainer's current weights, no push that only rewrote what the engine held, at most one
    full push per generate, and after every rollout the engine is asleep at level 2 as upstream (GPU memory freed)."""
    loop = TrainerLoop(make_generation(engine_class=PushAudit))
    for step in schedule_steps(loop):
        step()
        assert not (loop.engine.weights_awake or loop.engine.kv_cache_awake) and loop.engine.sleeps[-1] == 2
    assert loop.generates == 9 and loop.stale == 0
    assert loop.engine.disk_reloads == 0
    assert loop.engine.redundant_pushes == 0
    assert loop.max_full_pushes_per_generate <= 1.0


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
    assert trl_vlm_fixes.patches.reload_skip._engines.get(loop.generation) is None


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


@bug_present  # TRL >= 1.16: the fix steps aside (a generate after a manual sync and a step runs stale there)
def test_random_schedules_with_fix(make_generation: Callable[..., Any]) -> None:
    run_state_machine_as_test(_machine(make_generation), settings=SCHEDULE_SETTINGS)


@bug_present
def test_random_schedules_find_the_bug_upstream(make_generation: Callable[..., Any], fixes_off: None) -> None:
    with pytest.raises(AssertionError, match=r"stale or discarded|reloaded from disk"):
        run_state_machine_as_test(_machine(make_generation), settings=SCHEDULE_SETTINGS)


def colocate_sleep_trainer(make_trainer: Any) -> Any:
    """GRPO with use_vllm, colocate, sleep mode, 4 mixed prompts and two rollouts per optimizer step
    (gradient_accumulation_steps=2 > steps_per_generation=1), for 3 steps."""
    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, mixed_dataset

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
    assert "compilation_config" not in engine.init_kwargs  # cudagraph: vLLM's own mode (no hang reported)
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
    from vllm.v1.engine.llm_engine import LLMEngine

    from trl_vlm_fixes.selftest import engine_standin

    methods = [(vllm.LLM, StandInLLM, m) for m in ("sleep", "wake_up", "collective_rpc", "reset_prefix_cache")]
    methods += [(vllm.LLM, StandInLLM, "reset_mm_cache"), (vllm.LLM, StandInLLM, "generate")]
    methods += [(LLMEngine, engine_standin._EngineLoop, "reset_encoder_cache")]  # LLM has none of its own
    for real_class, our_class, method in methods:
        real = inspect.signature(getattr(real_class, method)).parameters
        ours = inspect.signature(getattr(our_class, method)).parameters
        assert list(ours) == list(real), method
        for name, parameter in ours.items():
            assert parameter.kind == real[name].kind, (method, name)
            if real[name].default is not inspect.Parameter.empty:
                assert parameter.default == real[name].default, (method, name)


def test_engine_arguments_are_ones_the_real_vllm_knows(make_generation: Callable[..., Any]) -> None:
    """Every argument TRL and the plugin pass to LLM(...) (captured by the stand-in) is a named parameter of the
    real ``LLM.__init__`` or a field of vLLM's ``EngineArgs``: ``**kwargs`` would accept a typo, this does not."""
    import dataclasses

    vllm = pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    known = set(inspect.signature(vllm.LLM.__init__).parameters) | {f.name for f in dataclasses.fields(EngineArgs)}
    passed = set(make_generation().llm.init_kwargs)
    assert {"model", "enable_sleep_mode"} <= passed  # (a pinned cudagraph mode's argument: test_vllm_arguments.py)
    assert passed <= known, passed - known


# --- several ranks, multi-turn tool loops: no collective of the plugin's, every turn on current weights ------


def run_tool_loop_ranks(model_dir: Any, tmp_path: Any, turns: str, env: dict[str, str] | None = None) -> list[Any]:
    """tests/programs/tool_loop_ranks.py under torchrun with 2 CPU processes (gloo); a deadlock fails the test."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from helpers import environment_without_switches

    from conftest import free_port

    program = Path(__file__).parent / "programs" / "tool_loop_ranks.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    command += [str(program), str(model_dir), str(tmp_path), turns]
    try:
        result = subprocess.run(
            command, env={**environment_without_switches(), **(env or {})}, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as timeout:
        raise AssertionError(f"two ranks with tool turns {turns} deadlocked (no end within 240 s)") from timeout
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((Path(tmp_path) / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_uneven_tool_turns_across_ranks_finish_on_current_weights(tiny_model_dir: Any, tmp_path: Any) -> None:
    """Rank 0 calls the tool twice per rollout (3 generates), rank 1 never (1): no deadlock, no collective of ours,
    every turn on the trainer's current weights, no disk reload, no push beyond TRL's own sync per step."""
    ranks = run_tool_loop_ranks(tiny_model_dir, tmp_path, "2,0")
    assert [r["generates"] for r in ranks] == [6, 2] and all(r["steps"] == 2 for r in ranks)
    # the same collectives, in the same order, with the same plugin frame on the stack: a push (parameter gather)
    # or any collective the plugin caused on one rank only would differ here. TRL >= 1.16 pushes the weights at
    # every tool turn itself (an upstream imbalance under ZeRO-3, not the plugin's): its gathers are left out there.
    trl_pushes_every_turn = not upstream_reloads_from_disk()

    def compared(record: dict[str, Any]) -> list[Any]:
        return [c for c in record["collectives"] if not (trl_pushes_every_turn and c[0].startswith("gather_params"))]

    assert compared(ranks[0]) == compared(ranks[1])
    assert any(op.startswith("gather_params") for op, _ in ranks[0]["collectives"]), "pushes are not recorded"
    for record in ranks:
        # a push of reload_skip's own (generate_wrapper -> sync_weights): none here, TRL's sync per step suffices
        own = [op for op, frames in record["collectives"] if "patches/reload_skip.py:generate_wrapper" in frames]
        assert own == [], own
        reduces = [op for op, frames in record["collectives"] if frames and frames[0].startswith("metrics.py")]
        assert reduces == ["all_reduce"] * len(record["logs"])  # metrics' one collective: once per log, every rank
        assert record["on_current_weights"] == record["generates"]
        assert record["disk_reloads"] == 0
        # sampling_parity in the tool loop: the policy's tokens of every turn weigh 1 (the tool's are masked)
        ratios = [log[k] for log in record["logs"] for k in log if k.startswith("sampling/importance_sampling_ratio")]
        assert ratios and all(abs(ratio - 1.0) < 1e-5 for ratio in ratios), ratios
        if upstream_reloads_from_disk():  # the fix acts (TRL >= 1.16 re-pushes every turn itself)
            # 3 + 1 skipped disk reloads per step (one per generate), the sum over ranks in every rank's log
            assert [log.get("trl_vlm_fixes/disk_reloads_skipped") for log in record["logs"][:2]] == [4.0, 4.0]
            assert record["full_pushes"] == record["steps"]  # TRL's own sync per step; later turns need no push


@bug_present
@pytest.mark.slow
def test_uneven_tool_turns_upstream_run_on_the_base_model(tiny_model_dir: Any, tmp_path: Any) -> None:
    ranks = run_tool_loop_ranks(tiny_model_dir, tmp_path, "2,0", env={"TRL_VLM_FIXES_RELOAD_SKIP": "0"})
    for record in ranks:
        assert record["disk_reloads"] == record["generates"]
        assert record["on_current_weights"] < record["generates"]  # after step 0, rollouts ran on the checkpoint


@bug_present
def test_tool_rollout_keeps_the_weights_between_turns(make_generation: Callable[..., Any]) -> None:
    loop = TrainerLoop(make_generation())
    loop.optimizer_step()
    pushes_before = loop.engine.tensor_pushes
    sleeps_before = len(loop.engine.sleeps)
    loop.tool_rollout(turns=4)
    assert loop.stale == 0 and loop.engine.disk_reloads == 0
    assert loop.engine.tensor_pushes - pushes_before == loop._parameters  # one push (TRL's sync) for 4 turns
    assert loop.engine.sleeps[sleeps_before:] == [2]  # the rollout ends asleep at level 2, as upstream


@bug_present
def test_a_generate_that_fails_half_way_is_followed_by_a_push(make_generation: Callable[..., Any]) -> None:
    """The engine's level-2 sleep discards the weights, then raises: the next generate must push them again."""

    class InterruptedSleep(StandInLLM):
        interrupt = False

        def sleep(self, level: int = 1, mode: str = "abort") -> None:
            super().sleep(level, mode)
            if self.interrupt:
                self.interrupt = False
                raise RuntimeError("interrupted while falling asleep")

    loop = TrainerLoop(make_generation(engine_class=InterruptedSleep))
    loop.trl_generate()
    loop.optimizer_step()
    loop.trl_generate()
    loop.engine.interrupt = True
    with pytest.raises(RuntimeError, match="interrupted"):
        loop.generate_again()
    loop.generate_again()
    assert loop.on_zeros == 0 and loop.stale == 0


def test_fingerprint_sees_and_misses_exactly_what_its_docstring_says() -> None:
    from trl_vlm_fixes.patches.reload_skip import parameters_fingerprint

    model = torch.nn.Linear(3, 2)
    start = parameters_fingerprint(model)
    with torch.no_grad():
        model.weight.add_(1.0)  # in place through the parameter: seen
    assert parameters_fingerprint(model) != start
    seen = parameters_fingerprint(model)
    model.bias = torch.nn.Parameter(torch.zeros(2))  # a replaced parameter: seen
    assert parameters_fingerprint(model) != seen
    seen = parameters_fingerprint(model)
    model.weight.data = torch.ones(2, 3)  # p.data = other: a new storage, seen
    assert parameters_fingerprint(model) != seen
    seen = parameters_fingerprint(model)
    model.weight.data.add_(1.0)  # through p.data: documented as not seen
    assert parameters_fingerprint(model) == seen
    flat = torch.zeros(6)
    model.weight.data = flat.view(2, 3)
    seen = parameters_fingerprint(model)
    flat.add_(1.0)  # through another alias of the storage (ZeRO-1/2 flat buffer): documented as not seen
    assert parameters_fingerprint(model) == seen


@pytest.mark.parametrize(
    ("body", "shape", "upstream"),
    [
        ("self.llm.collective_rpc( 'reload_weights' )\n        self.llm.generate()", None, None),
        ('self.llm.collective_rpc(\n            method="reload_weights",\n        )', None, None),
        ("self.sync_weights( )\n        self.llm.generate()", None, "re-pushes"),
        ("self.llm.generate()", "neither reloads", None),
        ("x = 'collective_rpc(\"reload_weights\")'  # only text", "neither reloads", None),
    ],
)
def test_source_guards_are_structural(tmp_path: Any, body: str, shape: str | None, upstream: str | None) -> None:
    """A modified copy of TRL's generate: quotes, spacing and line breaks change nothing; a string is not a call."""
    from helpers import module_from_source

    from trl_vlm_fixes.patches.reload_skip import _reload_shape, _upstream_repushes

    source = f"class VLLMGeneration:\n    def generate(self):\n        {body}\n"
    with module_from_source(tmp_path, "modified_vllm_generation", source) as module:
        generate = module.VLLMGeneration.generate
        problem = _reload_shape(generate)
        assert (problem is None) if shape is None else (shape in (problem or ""))
        verdict = _upstream_repushes(generate)
        assert (verdict is None) if upstream is None else (upstream in (verdict or ""))


def test_source_guards_on_the_installed_trl() -> None:
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_vlm_fixes.patches.reload_skip import _reload_shape, _upstream_repushes

    assert _reload_shape(VLLMGeneration.generate) is None
    assert (_upstream_repushes(VLLMGeneration.generate) is None) == upstream_reloads_from_disk()


# --- vLLM's caches after a push into an awake engine; level-1 sleep between tool turns -------------------------------


def image_prompt(processor: Any) -> tuple[list[int], Any]:
    from trl_vlm_fixes.selftest.fixtures import make_image

    image = make_image(96, 64)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]
    encoded = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"][0]), image


@bug_present
@pytest.mark.parametrize("trained_between_turns", [True, False])
def test_a_push_between_turns_drops_the_old_vision_embeddings(
    make_generation: Callable[..., Any], processor: Any, monkeypatch: pytest.MonkeyPatch, trained_between_turns: bool
) -> None:
    """Two turns of one rollout show the same image. If the trainer's weights change between them (the fingerprint
    path pushes into the awake engine), the second turn must not reuse the first turn's vision embeddings; if they
    do not change, the encoder cache is kept (no reset where none is needed)."""
    from trl_vlm_fixes.patches.reload_skip import rollout_scope

    loop = TrainerLoop(make_generation())
    generation, engine = loop.generation, loop.engine
    resets: list[int] = []
    reset = engine.llm_engine.reset_encoder_cache
    monkeypatch.setattr(engine.llm_engine, "reset_encoder_cache", lambda: resets.append(1) or reset())
    ids, image = image_prompt(processor)
    with rollout_scope(generation):
        generation.generate(prompts=[ids], images=[[image]], num_generations=1)
        if trained_between_turns:
            loop.optimizer_step()  # e.g. a rollout_func that trains between turns: no sync of TRL's
        generation.generate(prompts=[ids], images=[[image]], num_generations=1)
        assert engine.caches.encoder, "the image never reached the stand-in's encoder cache"
    assert engine.caches.stale_reads == []
    assert engine_weights_match(engine.rollouts[-1], trainer_weights(loop.model))
    assert len(resets) == trained_between_turns


@bug_present
def test_tool_sleep_frees_the_gpu_between_turns_without_a_push(
    make_generation: Callable[..., Any], with_setting: Callable[[str, str], None]
) -> None:
    """TRL_VLM_FIXES_RELOAD_SKIP_TOOL_SLEEP=1: where the tool runs, the engine holds neither weights nor KV cache on
    the GPU (level 1: weights in CPU memory); each turn runs on current weights with no push beyond TRL's sync."""
    from trl_vlm_fixes.patches.reload_skip import rollout_scope

    with_setting("TRL_VLM_FIXES_RELOAD_SKIP_TOOL_SLEEP", "1")
    loop = TrainerLoop(make_generation())
    engine = loop.engine
    loop.optimizer_step()
    pushes = engine.tensor_pushes
    freed_for_the_tool = []
    with rollout_scope(loop.generation):
        loop.trl_generate()
        for _ in range(3):
            freed_for_the_tool.append(not (engine.weights_awake or engine.kv_cache_awake) and engine.sleeps[-1] == 1)
            loop.generate_again()
    assert freed_for_the_tool == [True, True, True]
    assert not (engine.weights_awake or engine.kv_cache_awake)  # the rollout ends asleep
    loop.trl_generate()  # a second rollout in the same step: the weights come back from CPU memory
    assert loop.stale == 0 and engine.disk_reloads == 0
    assert engine.tensor_pushes - pushes == loop._parameters  # TRL's one sync for the step, nothing more
