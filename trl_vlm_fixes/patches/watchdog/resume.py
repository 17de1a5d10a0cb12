"""After a watchdog exit (75), the restart resumes from the last checkpoint; a hang that repeats gets safer settings.

Exit 75 helps only if the restart resumes. TRL's own ``trl grpo`` calls ``trainer.train()`` with no
``resume_from_checkpoint``, and transformers ignores that field of the training arguments by design
(huggingface/transformers#23325; huggingface/trl#3179, #3635): a job restarted by torchrun or SLURM starts again from
step 0. So, for GRPOTrainer and RLOOTrainer, ``train()`` called without ``resume_from_checkpoint``:

- honours the field of the training arguments (config file or CLI flag);
- else, when ``output_dir`` holds a hang report no run has resumed after (``trl_vlm_fixes_hang_rank{N}.txt``),
  resumes from its last checkpoint (transformers' ``get_last_checkpoint``), with one log line.

Every rank decides alike: the decision reads only files every rank sees (all ranks' reports and the checkpoints in the
shared ``output_dir``, which resuming needs anyway), and no rank renames a report (``.resumed.txt``: a later fresh
start is not resumed) before the first optimizer step of the resumed run has ended, which needs every rank's gradients,
so every rank has read them by then. No collective operation is added.

A hang at the step the run resumed at (the same batch replayed) is said so in its report (``REPEATED``); the restart
after it builds the engine with the protected settings (``protected_after_repeated_hang``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ...log_once import warn_once
from ...registry import TRAINERS, Target, on_trainers
from ...switches import WATCHDOG_RESUME_SWITCH, fix_enabled, read_bool
from . import report

LOGGER = logging.getLogger("trl_vlm_fixes")
RESUME_SWITCH = WATCHDOG_RESUME_SWITCH  # validated with the other switches at import
REPEATED = "repeated hang:"  # the line that marks a report as the second hang at one step
_UNUSED = re.compile(r"trl_vlm_fixes_hang_rank(\d+)\.txt")
_STEP = re.compile(r" at step (\d+)\.")
USED_SUFFIX = ".resumed.txt"

# the step of the hang this process restarted after (None: the last run did not end by the watchdog)
_restarted_after_step: int | None = None
# the output_dir of the GRPO/RLOO trainer being built (its engine is built inside __init__)
_building_output_dir: ContextVar[str | None] = ContextVar("trl_vlm_fixes_building_output_dir", default=None)


def unused_reports(output_dir: str | os.PathLike[str] | None) -> dict[Path, str]:
    """Every rank's hang report in ``output_dir`` that no run has resumed after: path -> text."""
    found: dict[Path, str] = {}
    if not output_dir or not os.path.isdir(output_dir):
        return found
    for path in sorted(Path(output_dir).iterdir()):
        if _UNUSED.fullmatch(path.name):
            with contextlib.suppress(OSError):
                found[path] = path.read_text(errors="replace")
    return found


def hang_step(text: str) -> int | None:
    """The step a report names on its first line (``... on rank 1 at step 3.``)."""
    match = _STEP.search(text.split("\n", 1)[0])
    return int(match.group(1)) if match else None


def protected_after_repeated_hang(output_dir: str | os.PathLike[str] | None = None) -> bool:
    """True when the last run in ``output_dir`` (default: that of the GRPO/RLOO trainer being built) ended in a hang
    at the step it had resumed at: its engine should drop the faster settings (CUDA graphs, FlashInfer prefill)."""
    directory = output_dir if output_dir is not None else _building_output_dir.get()
    reports = unused_reports(directory)
    repeated = [path for path, text in reports.items() if REPEATED in text]
    if repeated:
        _announce_protection(str(directory), repeated[0], hang_step(reports[repeated[0]]))
    return bool(repeated)


def _announce_protection(directory: str, path: Path, step: int | None) -> None:
    from ..cudagraph import PROTECTED_MODE, selected_mode
    from ..gdn_prefill import PROTECTED_BACKEND, selected_backend

    faster = []
    if fix_enabled("cudagraph") and selected_mode() != PROTECTED_MODE:
        faster.append(f"cudagraph_mode={selected_mode()} -> {PROTECTED_MODE}")
    if fix_enabled("gdn_prefill") and selected_backend() != PROTECTED_BACKEND:
        faster.append(f"gdn_prefill_backend={selected_backend()} -> {PROTECTED_BACKEND}")
    if faster:
        warn_once(
            ("protected", directory),
            "trl_vlm_fixes.watchdog: the last run hung twice at step %s (%s): this engine is built with the "
            "protected settings (%s).",
            step,
            path,
            ", ".join(faster),
        )


def _repeat_note(context: report.HangContext) -> str | None:
    """The report's line for a hang at the very step this process restarted after."""
    if _restarted_after_step is None or str(context.step) != str(_restarted_after_step):
        return None
    prefill = ", gdn_prefill_backend=triton"  # where gdn_prefill acts: not where the kernel it avoids is gone
    with contextlib.suppress(Exception):  # a report is being written: nothing here may stop it
        from ..gdn_prefill import kernel_gone

        prefill = "" if kernel_gone() else prefill
    return (
        f"{REPEATED} the run restarted after a hang at step {context.step} and hung again at step {context.step} "
        f"(the same batch replayed): the restart builds the engine with the protected settings (cudagraph_mode=NONE"
        f"{prefill})."
    )


if _repeat_note not in report.NOTES:
    report.NOTES.append(_repeat_note)


def _is_rl_trainer(instance: Any) -> bool:
    return any((cls.__module__, cls.__name__) in TRAINERS for cls in type(instance).__mro__)


def _argument_value(value: Any) -> Any:
    """The ``resume_from_checkpoint`` field as ``train()`` takes it: a path, or True for the last checkpoint."""
    if isinstance(value, str) and value.strip().lower() in ("true", "yes", "1", "last"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "no", "0"):
        return False  # said explicitly: no resume, not even after a hang
    return value or None


def _resume_point(trainer: Any, reports: dict[Path, str]) -> Any:
    """What this rank's ``train()`` resumes from: the arguments' field, else the last checkpoint after a hang."""
    from_arguments = _argument_value(getattr(trainer.args, "resume_from_checkpoint", None))
    if from_arguments is not None or not reports:
        return from_arguments
    output_dir = str(trainer.args.output_dir)
    if getattr(trainer.args, "save_on_each_node", False):
        # node-local output dirs: only the hung rank's node would see the report and resume, the others would start
        # at step 0, and their collectives would stop matching
        LOGGER.warning(
            "trl_vlm_fixes.watchdog: the last run in %s ended by the watchdog, but save_on_each_node=True (output "
            "dirs may be node-local): not resuming on my own; pass resume_from_checkpoint to resume.",
            output_dir,
        )
        return None
    last = last_complete_checkpoint(output_dir)
    steps = sorted({step for step in map(hang_step, reports.values()) if step is not None})
    if trainer.is_world_process_zero():
        LOGGER.warning(
            "trl_vlm_fixes.watchdog: the last run in %s ended by the rollout watchdog (hang at step %s: %s); %s "
            "(%s=0 to start fresh, or rename the report).",
            output_dir,
            ", ".join(map(str, steps)) or "?",
            ", ".join(path.name for path in reports),
            f"resuming from {last}" if last else "no checkpoint in it yet: starting from step 0",
            RESUME_SWITCH,
        )
    return last


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` holding its ``trainer_state.json`` (written last by transformers' save): a save cut
    short by the end of the process is passed over instead of failing every restart."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    candidates = []
    for path in Path(output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        step = path.name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if step.isdigit() and (path / "trainer_state.json").is_file():
            candidates.append((int(step), str(path)))
    return max(candidates)[1] if candidates else None


def _reports_used(reports: dict[Path, str]) -> Any:
    """A callback that renames the reports once the first optimizer step ended (every rank has read them by then)."""
    from transformers import TrainerCallback

    class ReportsUsed(TrainerCallback):  # type: ignore[misc]
        done = False

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.done:
                return
            self.done = True
            if not state.is_local_process_zero:
                return
            for path in reports:
                with contextlib.suppress(OSError):  # another node's process zero renamed it first
                    path.rename(path.with_name(path.name.removesuffix(".txt") + USED_SUFFIX))

    return ReportsUsed()


def train_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Trainer.train`` of a GRPO/RLOO trainer: resume as described above when the caller named no checkpoint."""
    if not _is_rl_trainer(instance) or not read_bool(RESUME_SWITCH, True):
        return wrapped(*args, **kwargs)
    global _restarted_after_step
    reports = unused_reports(getattr(instance.args, "output_dir", None))
    steps = [step for step in map(hang_step, reports.values()) if step is not None]
    _restarted_after_step = max(steps) if steps else None
    given = args[0] if args else kwargs.get("resume_from_checkpoint")
    if given is None:
        point = _resume_point(instance, reports)
        if point is not None and args:
            args = (point, *args[1:])
        elif point is not None:
            kwargs = {**kwargs, "resume_from_checkpoint": point}
    if not reports:
        return wrapped(*args, **kwargs)
    callback = _reports_used(reports)
    instance.add_callback(callback)
    try:
        return wrapped(*args, **kwargs)
    finally:
        with contextlib.suppress(ValueError):
            instance.remove_callback(callback)


def init_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The trainer's ``__init__``: its ``output_dir`` is known while it builds the engine."""
    try:
        arguments = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments.get("args")
    except TypeError:
        arguments = None
    token = _building_output_dir.set(getattr(arguments, "output_dir", None))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _building_output_dir.reset(token)


RESUME_TARGETS: tuple[Target, ...] = (
    Target("transformers.trainer", "Trainer.train", train_wrapper, required_parameters=("resume_from_checkpoint",)),
    *on_trainers({"__init__": init_wrapper}),
)
