"""A real GRPOTrainer (use_vllm colocate, the engine stand-in) whose engine's generate never returns on HANG_RANK.

usage: hang_generate.py MODEL_DIR OUTPUT_DIR      (HANG_RANK: the rank that hangs, default 0; -1: none hangs)
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import trl_vlm_fixes  # noqa: F401 - the plugin under test


def main() -> int:
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    hang_rank = int(os.environ.get("HANG_RANK", "0"))
    from transformers import AutoProcessor
    from trl.generation import vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, build_trainer, mixed_dataset

    class WedgedEngine(StandInLLM):
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            if int(os.environ.get("RANK", "0")) == hang_rank:
                with open(os.path.join(output_dir, "hang_started"), "w") as marker:
                    marker.write(str(time.time()))
                while True:  # a kernel that never finishes: the call never returns to TRL
                    time.sleep(3600)
            return super().generate(*args, **kwargs)

    vllm_generation.LLM = WedgedEngine
    processor = AutoProcessor.from_pretrained(model_dir)
    dataset = mixed_dataset(MIXED_SAMPLES)
    trainer = build_trainer(
        model_dir, processor, output_dir, "grpo", use_vllm=True, vllm_mode="colocate", dataset=dataset
    )
    trainer.train()
    print("trained", trainer.state.global_step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
