"""Two ranks (torchrun, gloo, CPU) count different amounts; each writes what its trainer's ``log`` recorded.

The trainer is a stand-in holding what the plugin's ``log`` wrapper reads (a real ``Accelerator``, ``model``,
``_metrics``, ``vllm_generation``), so the wrapper runs exactly as on GRPOTrainer/RLOOTrainer without building one.

usage: metrics_ranks.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

import torch
from accelerate import Accelerator

from trl_vlm_fixes import metrics
from trl_vlm_fixes.patches import ALL_FIXES

# every fix's declared counter by its metric name in capitals, as tests/helpers.py names them
counters = type(
    "Counters", (), {c.name.removeprefix("trl_vlm_fixes/").upper(): c for fix in ALL_FIXES for c in fix.counters}
)

# per rank, per logging interval: (owner, counter, amount) counted before the log
COUNTS: dict[int, list[list[tuple[str, Any, Any]]]] = {
    0: [
        [
            ("trainer", counters.MM_REALIGNED_ROWS, torch.tensor(3)),
            ("generation", counters.WEIGHT_REPUSHES, 1),
            ("trainer", counters.SAMPLING_KEPT_MASS, (torch.tensor(9.0), torch.tensor(10))),  # 10 tokens, 0.9 each
        ],
        [],  # this rank counts nothing in the second interval, the other does
    ],
    1: [
        [
            ("trainer", counters.MM_REALIGNED_ROWS, torch.tensor(5)),
            ("trainer", counters.VISION_TOKEN_ROWS_MASKED, 2),
            ("trainer", counters.SAMPLING_KEPT_MASS, (15.0, 30)),  # 30 tokens, 0.5 each
        ],
        [("generation", counters.PROMPT_MISMATCH_ROWS, 0), ("generation", counters.WEIGHT_REPUSHES, 4)],
    ],
}


class Trainer:
    def __init__(self) -> None:
        self.accelerator = Accelerator(cpu=True)
        self.model = torch.nn.Linear(2, 2)
        self.vllm_generation = type("Generation", (), {})()
        self._metrics: dict[str, defaultdict[str, list[float]]] = {m: defaultdict(list) for m in ("train", "eval")}


def main() -> int:
    trainer = Trainer()
    rank = trainer.accelerator.process_index
    logged = []
    for interval in COUNTS[rank]:
        for owner, counter, amount in interval:
            holder = trainer if owner == "trainer" else trainer.vllm_generation
            if counter.kind == "mean":
                metrics.count_mean(holder, counter, *amount)
            else:
                metrics.count(holder, counter, amount)
        metrics.flush_into_trainer_log(lambda: None, trainer, (), {})
        logged.append({name: values for name, values in trainer._metrics["train"].items()})
        trainer._metrics["train"].clear()  # as TRL's log does after reading them
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump(logged, handle)
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
