"""A real GRPOTrainer (use_vllm, the engine stand-in) whose step is slow or hangs in one phase.

usage: hang_phase.py MODEL_DIR OUTPUT_DIR
  PHASE=steady           the first rollout's engine steps take STEP_SECONDS each (default 1): a long rollout that
                         makes progress all along
  PHASE=stalls           after STEADY_STEPS engine steps of the first rollout, the next step never returns
  PHASE=sync_weights     the second weight push to the engine never returns (the first one taught its limit)
  PHASE=server_generate  server mode (`trl vllm-serve` stood in, text prompts): the second generate never returns
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
    while True:  # a kernel, a server or a collective that never finishes
        time.sleep(3600)


def main() -> int:
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    phase = os.environ["PHASE"]
    step_seconds = float(os.environ.get("STEP_SECONDS", "1"))
    steady_steps = int(os.environ.get("STEADY_STEPS", "3"))
    from transformers import AutoProcessor
    from trl.generation import vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, build_trainer, mixed_dataset, text_dataset

    class Engine(StandInLLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            loop, loader = self.llm_engine, self.llm_engine.model_executor.driver_worker.model_runner.model
            step, load, pushes = loop.step, loader.load_weights, set()

            def slow_step() -> Any:
                first_rollout = len(self.rollouts) == 1
                if first_rollout and phase == "stalls" and loop.steps >= steady_steps:
                    hang(output_dir)
                if first_rollout and phase in ("steady", "stalls"):
                    time.sleep(step_seconds)
                return step()

            def load_weights(weights: Any) -> Any:
                pushes.add(holder["trainer"].state.global_step)
                if phase == "sync_weights" and len(pushes) == 2:
                    hang(output_dir)
                return load(weights)

            loop.step, loader.load_weights = slow_step, load_weights

    holder: dict[str, Any] = {}
    vllm_generation.LLM = Engine
    settings: dict[str, Any] = {"vllm_mode": "colocate", "dataset": mixed_dataset(MIXED_SAMPLES)}
    if phase == "server_generate":
        sys.path.insert(0, str(Path(__file__).parents[1]))
        from helpers import StandInServer

        class Server(StandInServer):
            calls = 0

            def generate(self, *args: Any, **kwargs: Any) -> Any:
                type(self).calls += 1
                if type(self).calls == 2:
                    hang(output_dir)
                return super().generate(*args, **kwargs)

        Server.model_dir = model_dir
        from vllm import SamplingParams

        Server._engine = StandInLLM(model_dir, logprobs_mode="processed_logprobs")  # the server is up and warm
        Server._engine.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=1))
        vllm_generation.VLLMClient = Server
        vllm_generation.is_vllm_available = lambda *a, **k: True
        settings = {"vllm_mode": "server", "dataset": text_dataset()}
    processor = AutoProcessor.from_pretrained(model_dir)
    trainer = build_trainer(
        model_dir,
        processor,
        output_dir,
        "grpo",
        use_vllm=True,
        max_steps=int(os.environ.get("MAX_STEPS", "1")),
        max_completion_length=int(os.environ.get("TOKENS", "8")),
        **settings,
    )
    holder["trainer"] = trainer
    started = time.monotonic()
    trainer.train()
    engine = getattr(trainer.vllm_generation, "llm", None)
    engine_steps = engine.llm_engine.steps if engine is not None else 0
    print(f"trained {trainer.state.global_step} in {time.monotonic() - started:.1f} s, {engine_steps} engine steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
