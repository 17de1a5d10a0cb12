"""Which checkpoint a restart may resume into: one holding everything transformers restores, as this run saves it.

transformers' ``_save_checkpoint`` writes the weights, then (unless ``save_only_model``) the optimizer, the scheduler
and each rank's RNG state (every rank on its own, no barrier), and ``trainer_state.json`` last, from rank 0. Its
loaders skip a missing optimizer, scheduler or RNG file without a word (``_load_optimizer_and_scheduler``,
``_load_rng_state``): resuming into such a checkpoint silently restarts Adam's moments and the learning-rate schedule.
So a checkpoint is resumable only when every file the run reads back is there; a save cut short is passed over.
"""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "checkpoint-"


def missing(checkpoint: str | os.PathLike[str], world_size: int, deepspeed: bool) -> list[str]:
    """The files ``checkpoint`` lacks for a full resume by a run of ``world_size`` ranks (empty: it can resume)."""
    try:
        names = set(os.listdir(checkpoint))
    except OSError as error:
        return [f"(unreadable: {error.strerror})"]
    lacks = [] if "trainer_state.json" in names else ["trainer_state.json"]
    if deepspeed:  # DeepSpeed's own directory holds the optimizer (and its scheduler)
        lacks += [] if any(name.startswith("global_step") for name in names) else ["global_step*/ (DeepSpeed state)"]
    else:  # optimizer.pt, optimizer.bin, or FSDP's optimizer_0/
        lacks += [] if any(name.startswith("optimizer") for name in names) else ["optimizer.pt"]
        lacks += [] if "scheduler.pt" in names else ["scheduler.pt"]
    rng = ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{rank}.pth" for rank in range(world_size)]
    return lacks + [name for name in rng if name not in names]


def last_resumable(output_dir: str, world_size: int, deepspeed: bool) -> tuple[str | None, str]:
    """The newest resumable ``checkpoint-N`` of ``output_dir``; else None and why the newest one is not."""
    steps = sorted(
        (int(path.name.removeprefix(PREFIX)), path)
        for path in Path(output_dir).glob(f"{PREFIX}*")
        if path.name.removeprefix(PREFIX).isdigit() and path.is_dir()
    )
    newest_problem = "no checkpoint in it yet"
    for index, (_, path) in enumerate(reversed(steps)):
        lacks = missing(path, world_size, deepspeed)
        if not lacks:
            return str(path), ""
        if index == 0:
            newest_problem = f"{path.name} lacks {', '.join(lacks)}"
    return None, newest_problem
