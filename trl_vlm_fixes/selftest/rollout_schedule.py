"""Drive TRL's real VLLMGeneration on the engine stand-in the way its trainers do (tests, self-test, benchmarks)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .engine_standin import engine_weights_match, trainer_weights


class TrainerLoop:
    """TRL's calling pattern: sync when ``global_step`` changed, then generate (GRPOTrainer._generate)."""

    def __init__(self, generation: Any) -> None:
        self.generation = generation
        self.model = generation.model
        self.engine = generation.llm
        self.global_step = 0
        self.last_loaded_step = -1
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
        self.generates = 0
        self.stale = 0  # rollouts that ran on anything but the trainer's current weights
        self.on_checkpoint = 0  # ... of which on the original checkpoint (base model)
        self.on_zeros = 0  # ... of which on discarded (all-zero) weights
        self.max_full_pushes_per_generate = 0.0
        self._pushes_at_last_generate = 0
        self._parameters = sum(1 for _ in self.model.parameters())

    def optimizer_step(self) -> None:
        generator = torch.Generator().manual_seed(self.global_step)
        for parameter in self.model.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.global_step += 1

    def sync(self) -> None:
        """A sync of its own (not for a rollout): its push is not counted against the next generate."""
        self.generation.sync_weights()
        self._pushes_at_last_generate = self.engine.tensor_pushes

    def trl_generate(self) -> None:
        """One rollout as GRPOTrainer._generate does it (evaluation takes the same path)."""
        if self.global_step != self.last_loaded_step:
            self.generation.sync_weights()
            self.last_loaded_step = self.global_step
        self.generate_again()

    def tool_rollout(self, turns: int) -> None:
        """One trainer rollout of ``turns`` generates (a multi-turn tool loop inside GRPOTrainer._generate).

        With reload_skip applied, the trainer's ``_generate`` is one rollout scope (the wrapper the fix puts on it);
        upstream it is just several generates in a row.
        """
        from contextlib import nullcontext

        from trl_vlm_fixes.patches.reload_skip import rollout_scope
        from trl_vlm_fixes.registry import WRAPPED_STATES, active

        wrapped = active().fix_state("reload_skip")[0] in WRAPPED_STATES
        with rollout_scope(self.generation) if wrapped else nullcontext():
            self.trl_generate()
            for _ in range(turns - 1):
                self.generate_again()

    def generate_again(self) -> None:
        """A generate with no sync before it: another generation in the same step, or a tool-loop turn."""
        self.generation.generate(prompts=[[1, 2, 3], [4, 5, 6]], images=None, num_generations=1)
        self.generates += 1
        snapshot = self.engine.rollouts[-1]
        current = trainer_weights(self.model)
        if not engine_weights_match(snapshot, current):
            self.stale += 1
            self.on_checkpoint += engine_weights_match(snapshot, self.engine.checkpoint)
            self.on_zeros += all(not t.any() for t in snapshot.values())
        pushes = self.engine.tensor_pushes - self._pushes_at_last_generate
        self._pushes_at_last_generate = self.engine.tensor_pushes
        self.max_full_pushes_per_generate = max(self.max_full_pushes_per_generate, pushes / self._parameters)


def run_schedule(loop: TrainerLoop) -> None:
    """Step 0, then two training steps with a second rollout in the same step (steps_per_generation <
    gradient_accumulation_steps), a three-turn tool-loop rollout, a lone generate and an evaluation rollout."""
    loop.trl_generate()
    loop.optimizer_step()
    loop.trl_generate()
    loop.trl_generate()  # same global_step: TRL does not sync
    loop.tool_rollout(turns=3)  # multi-turn tool loop in one rollout
    loop.generate_again()  # a generate outside any trainer rollout
    loop.optimizer_step()
    loop.trl_generate()
    loop.trl_generate()  # evaluation after the step: same path, no sync


@contextmanager
def standin_engine_installed(engine_class: Any = None) -> Iterator[None]:
    """While the block runs, TRL builds the stand-in engine wherever it builds a colocated ``vllm.LLM``."""
    import importlib

    vllm_generation: Any = importlib.import_module("trl.generation.vllm_generation")
    saved = getattr(vllm_generation, "LLM", None)
    from .engine_standin import StandInLLM

    vllm_generation.LLM = engine_class or StandInLLM
    try:
        yield
    finally:
        if saved is None:
            del vllm_generation.LLM
        else:
            vllm_generation.LLM = saved


def build_generation(
    model_dir: Any,
    processor: Any,
    enable_sleep_mode: bool = True,
    engine_class: Any = None,
    text_only: bool = False,
    model: Any = None,
) -> Any:
    """TRL's real VLLMGeneration in colocate mode, on the stand-in engine (or ``engine_class``: the module's LLM is
    swapped meanwhile), for the checkpoint in ``model_dir`` or an already built trainer ``model``."""
    import importlib

    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from .engine_standin import StandInLLM, StandInSamplingParams

    vllm_generation: Any = importlib.import_module("trl.generation.vllm_generation")

    if not hasattr(vllm_generation, "SamplingParams"):  # vLLM not installed: generate() needs a stand-in too
        vllm_generation.SamplingParams = StandInSamplingParams
    saved = {name: getattr(vllm_generation, name, None) for name in ("LLM", "is_vllm_available")}
    vllm_generation.LLM = engine_class or StandInLLM
    vllm_generation.is_vllm_available = lambda *a, **k: True
    try:
        return vllm_generation.VLLMGeneration(
            model=model
            or (AutoModelForCausalLM if text_only else AutoModelForImageTextToText).from_pretrained(model_dir),
            accelerator=Accelerator(cpu=True),
            processing_class=processor,
            mode="colocate",
            enable_sleep_mode=enable_sleep_mode,
            max_completion_length=4,
        )
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(vllm_generation, name)
            else:
                setattr(vllm_generation, name, value)
