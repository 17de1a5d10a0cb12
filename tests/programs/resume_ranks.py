"""A real GRPOTrainer (colocate + sleep mode, the engine stand-in, a checkpoint every step) whose engine wedges.

WEDGE_RANK's generate never returns at WEDGE_STEP (the trainer's global_step), the first WEDGE_TIMES times it gets
there (counted with marker files in RECORDS_DIR, so it holds across restarts). Runs alone or under torchrun (gloo).
Each rank appends JSON lines to RECORDS_DIR/rank{N}.jsonl: the engine build ("start": was the engine to be protected
after a repeated hang, and the engine arguments), every rollout ("generate": the step, and whether the engine ran on
the trainer's weights and on the base checkpoint) and the end ("end": the final step). BUILD_ONLY=1: build, record,
exit.

usage: resume_ranks.py MODEL_DIR OUTPUT_DIR RECORDS_DIR     (MAX_STEPS default 5, WEDGE_RANK 1, WEDGE_STEP 3)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from program_end import end_program

import trl_vlm_fixes  # noqa: F401 - the plugin under test


def cpu_ranks_can_resume() -> None:
    """A shim for this CPU harness only: transformers loads the optimizer state with ``map_location=args.device``
    when several ranks run, ``cpu:N`` on CPU ranks, which torch cannot restore to (GPU ranks get ``cuda:N``)."""
    import torch

    original = torch.load

    def load(*args: Any, map_location: Any = None, **kwargs: Any) -> Any:
        if isinstance(map_location, torch.device) and map_location.type == "cpu":
            map_location = "cpu"
        return original(*args, map_location=map_location, **kwargs)

    torch.load = load


def fresh_rendezvous_per_restart() -> None:
    """A shim for this harness: torchrun (torch 2.14) hands a restarted round the agent's store with the dead round's
    gloo addresses still in it ("Connection refused" to a dead rank); a prefix per restart keeps the rounds apart."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    prefixed = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world_size)


def main() -> int:
    model_dir, output_dir, records = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    records.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    wedge_rank = int(os.environ.get("WEDGE_RANK", "1"))
    wedge_step = int(os.environ.get("WEDGE_STEP", "3"))
    wedge_times = int(os.environ.get("WEDGE_TIMES", "1"))
    cpu_ranks_can_resume()
    fresh_rendezvous_per_restart()
    from transformers import AutoProcessor
    from trl.generation import vllm_generation

    from trl_vlm_fixes.patches.watchdog.resume import protected_after_repeated_hang
    from trl_vlm_fixes.selftest.engine_standin import StandInLLM, engine_weights_match, trainer_weights
    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, build_trainer, mixed_dataset

    def record(event: str, **fields: Any) -> None:
        with open(records / f"rank{rank}.jsonl", "a") as handle:
            handle.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")

    holder: dict[str, Any] = {}

    class WedgingEngine(StandInLLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.protected = protected_after_repeated_hang()  # built inside the trainer's __init__

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            step = holder["trainer"].state.global_step
            wedged = sorted(records.glob("wedged*"))
            if rank == wedge_rank and step == wedge_step and len(wedged) < wedge_times:
                (records / f"wedged{len(wedged)}").write_text(str(time.time()))
                while True:  # a kernel that never finishes: the call never returns to TRL
                    time.sleep(3600)
            outputs = super().generate(*args, **kwargs)
            rollout = self.rollouts[-1]
            record(
                "generate",
                step=step,
                on_trainer=engine_weights_match(rollout, trainer_weights(holder["trainer"].model)),
                on_base=engine_weights_match(rollout, self.checkpoint),
            )
            return outputs

    vllm_generation.LLM = WedgingEngine
    processor = AutoProcessor.from_pretrained(model_dir)
    trainer = build_trainer(
        model_dir, processor, output_dir, "grpo", use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
        dataset=mixed_dataset(MIXED_SAMPLES), max_steps=int(os.environ.get("MAX_STEPS", "5")), learning_rate=0.05,
        save_strategy="steps", save_steps=1,
    )
    holder["trainer"] = trainer
    engine = trainer.vllm_generation.llm
    record("start", protected=engine.protected, compilation_config=engine.init_kwargs.get("compilation_config"),
           gdn_prefill_backend=engine.init_kwargs.get("gdn_prefill_backend"))
    if os.environ.get("BUILD_ONLY") != "1":
        trainer.train()
        record("end", steps=trainer.state.global_step)
    end_program(trainer.accelerator)


if __name__ == "__main__":
    sys.exit(main())
