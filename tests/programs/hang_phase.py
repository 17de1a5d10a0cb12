"""A real GRPOTrainer (use_vllm colocate, the engine stand-in) whose step is slow or hangs in one phase.

usage: hang_phase.py MODEL_DIR OUTPUT_DIR
  PHASE=steady          the first rollout's engine steps take STEP_SECONDS each (default 1): a long rollout that
                        makes progress all along
  PHASE=stalls          after STEADY_STEPS engine steps of the first rollout, the next step never returns
  PHASE=sync_weights    the first weight push to the engine never returns
  PHASE=optimizer_step  the first optimizer step never returns
Writes OUTPUT_DIR/hang_started (time.time()) when the hang starts; prints "trained N" and the engine's step count.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import trl_vlm_fixes  # noqa: F401 - the plugin under test


def hang(output_dir: str) -> None:
    Path(output_dir, "hang_started").write_text(str(time.time()))
    while True:  # a kernel or a collective that never finishes
        time.sleep(3600)


def main() -> int:
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    phase = os.environ["PHASE"]
    step_seconds = float(os.environ.get("STEP_SECONDS", "1"))
    steady_steps = int(os.environ.get("STEADY_STEPS", "3"))
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from transformers import AutoProcessor
    from trl.generation import vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, build_trainer, mixed_dataset

    class Engine(StandInLLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            loop = self.llm_engine
            step = loop.step

            def slow_step() -> Any:
                first_rollout = len(self.rollouts) == 1
                if first_rollout and phase == "stalls" and loop.steps >= steady_steps:
                    hang(output_dir)
                if first_rollout and phase in ("steady", "stalls"):
                    time.sleep(step_seconds)
                return step()

            loop.step = slow_step
            if phase == "sync_weights":
                self.llm_engine.model_executor.driver_worker.model_runner.model.load_weights = lambda weights: hang(
                    output_dir
                )

    if phase == "optimizer_step":  # inside torch's step wrapper, before the plugin's own post-hook (registered later)
        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: hang(output_dir))
    vllm_generation.LLM = Engine
    processor = AutoProcessor.from_pretrained(model_dir)
    trainer = build_trainer(
        model_dir, processor, output_dir, "grpo", use_vllm=True, vllm_mode="colocate",
        dataset=mixed_dataset(MIXED_SAMPLES), max_steps=1, max_completion_length=int(os.environ.get("TOKENS", "8")),
    )
    started = time.monotonic()
    trainer.train()
    engine_steps = trainer.vllm_generation.llm.llm_engine.steps
    print(f"trained {trainer.state.global_step} in {time.monotonic() - started:.1f} s, {engine_steps} engine steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
