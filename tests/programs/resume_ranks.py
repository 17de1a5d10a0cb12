"""A real GRPOTrainer (colocate + sleep mode, the engine stand-in, a checkpoint every step) whose engine may wedge,
whose first weight push or rank 0's save may be slow. Runs alone or under torchrun (gloo).

usage: resume_ranks.py MODEL_DIR OUTPUT_DIR RECORDS_DIR
  MAX_STEPS (5)            steps to train
  WEDGE_RANK (1), WEDGE_STEP (3), WEDGE_TIMES (1)
                           that rank's engine generate never returns at that step (the trainer's global_step), the
                           first WEDGE_TIMES times it gets there (marker files in RECORDS_DIR: it holds across restarts)
  TP (1)                   vllm_tensor_parallel_size (2: TRL's colocate prompt gather across the two ranks)
  SLOW_SAVE_SECONDS (0), SLOW_SAVE_STEPS ("1")
                           rank 0's checkpoint save at those steps sleeps that long mid-save (after the weights)
  SLOW_PUSH_SECONDS (0)    the first weight push of each process takes that long
  HANG_PUSH (0)            1: the second weight push of the first process that gets there never returns (a marker in
                           RECORDS_DIR: once over all runs)
  NODE_LOCAL (0)           1: each rank writes into OUTPUT_DIR/rank{N} with save_on_each_node=True (node-local dirs)
  SAVE_ONLY_MODEL (0)      save_only_model=True
  CRASH_AT_GENERATE (0)    1: the process's first rollout is recorded, then raises (the run never ends a step)
  BUILD_ONLY (0)           1: build the trainer, record the engine arguments, exit
Each rank appends JSON lines to RECORDS_DIR/rank{N}.jsonl: "start" (the compilation config and GDN prefill backend
the engine received, the CUDA-graph mode it reports), "generate" (the step, when the engine was called, whether it ran
on the trainer's weights and on the base checkpoint), "saved" (rank 0 after a slow save), "end" (the final step).
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


def setting(name: str, default: str = "0") -> int:
    return int(os.environ.get(name, default))


def main() -> None:
    model_dir, output_dir, records = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    records.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    node_local = bool(setting("NODE_LOCAL"))
    if node_local:
        output_dir = os.path.join(output_dir, f"rank{rank}")
    wedge_rank, wedge_step = setting("WEDGE_RANK", "1"), setting("WEDGE_STEP", "3")
    wedge_times = setting("WEDGE_TIMES", "1")
    slow_push, crash = setting("SLOW_PUSH_SECONDS"), setting("CRASH_AT_GENERATE")
    cpu_ranks_can_resume()
    fresh_rendezvous_per_restart()
    from transformers import AutoProcessor
    from trl.generation import vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM, engine_weights_match, trainer_weights
    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, build_trainer, mixed_dataset

    def record(event: str, **fields: Any) -> None:
        with open(records / f"rank{rank}.jsonl", "a") as handle:
            handle.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")

    holder: dict[str, Any] = {}

    class WedgingEngine(StandInLLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            loader = self.llm_engine.model_executor.driver_worker.model_runner.model
            load, pushes = loader.load_weights, []

            def load_weights(weights: Any) -> Any:
                if slow_push and not pushes:  # the first push of this process is slow (a large model, a cold device)
                    time.sleep(slow_push)
                if setting("HANG_PUSH") and len(pushes) == 1 and not (records / "push_hung").exists():
                    (records / "push_hung").write_text(str(time.time()))
                    while True:  # a push that never returns (the first one taught the watchdog its limit)
                        time.sleep(3600)
                pushes.append(1)
                return load(weights)

            loader.load_weights = load_weights

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            step, entered = holder["trainer"].state.global_step, time.time()
            wedged = sorted(records.glob("wedged*"))
            if rank == wedge_rank and step == wedge_step and len(wedged) < wedge_times:
                (records / f"wedged{len(wedged)}").write_text(str(time.time()))
                while True:  # a kernel that never finishes: the call never returns to TRL
                    time.sleep(3600)
            if crash:
                record("generate", step=step)
                raise RuntimeError("CRASH_AT_GENERATE: this run dies before it ends a step")
            outputs = super().generate(*args, **kwargs)
            rollout = self.rollouts[-1]
            record(
                "generate",
                step=step,
                entered=entered,
                on_trainer=engine_weights_match(rollout, trainer_weights(holder["trainer"].model)),
                on_base=engine_weights_match(rollout, self.checkpoint),
            )
            return outputs

    vllm_generation.LLM = WedgingEngine
    processor = AutoProcessor.from_pretrained(model_dir)
    trainer = build_trainer(
        model_dir,
        processor,
        output_dir,
        "grpo",
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        dataset=mixed_dataset(MIXED_SAMPLES),
        max_steps=setting("MAX_STEPS", "5"),
        learning_rate=0.05,
        save_strategy="steps",
        save_steps=1,
        save_only_model=bool(setting("SAVE_ONLY_MODEL")),
        vllm_tensor_parallel_size=setting("TP", "1"),
        save_on_each_node=node_local,
    )
    holder["trainer"] = trainer
    slow_save, slow_steps = setting("SLOW_SAVE_SECONDS"), os.environ.get("SLOW_SAVE_STEPS", "1").split(",")
    if slow_save and rank == 0:
        save_optimizer = trainer._save_optimizer_and_scheduler

        def slow_save_optimizer(checkpoint_dir: str) -> None:  # mid-save: the weights are written, the rest is not
            if str(trainer.state.global_step) in slow_steps:
                time.sleep(slow_save)
            save_optimizer(checkpoint_dir)
            record("saved", step=trainer.state.global_step, at=time.time())

        trainer._save_optimizer_and_scheduler = slow_save_optimizer
    llm = trainer.vllm_generation.llm
    kwargs = llm.init_kwargs
    record(
        "start",
        compilation_config=kwargs.get("compilation_config"),
        gdn_prefill_backend=kwargs.get("gdn_prefill_backend"),
        built_mode=llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name,  # what the engine reports
    )
    if not setting("BUILD_ONLY"):
        trainer.train()
        record("end", steps=trainer.state.global_step)
    end_program(trainer.accelerator)


if __name__ == "__main__":
    main()
