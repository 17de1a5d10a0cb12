"""After a watchdog exit (75) the restart resumes, into a checkpoint that can resume. (The engine it builds gets the
protection recorded in ``output_dir``'s protection state, ``protection.py``: the reports are for resume and diagnosis.)

TRL's ``trl grpo`` calls ``train()`` without ``resume_from_checkpoint`` and transformers ignores that field of the
arguments (transformers#23325; TRL #3179, #3635). So a GRPO/RLOO ``train()`` called without one honours the field,
else, after a hang report no run has used (``trl_vlm_fixes_hang_rank{N}.txt``), resumes from the newest checkpoint
that can resume (``checkpoints.py``), or says in one line why none can and starts as upstream does. Every rank decides
from the same files: no collective is added. World process zero renames the reports ``*.resumed.txt`` at
``on_train_begin`` (so a later start there does not resume again): every rank read them when its ``train()`` began,
before accelerate's ``prepare`` of the model, whose collectives (DDP's parameter check, FSDP's or DeepSpeed's set-up) no
rank leaves before all entered them.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import protection
from ...declaration import Target, is_rl_trainer, on_trainers
from ...logs import fix_logger
from ...registry import value
from ...switches import boolean
from . import checkpoints

__all__ = ["RESUME", "RESUME_TARGETS", "unused_reports"]
LOGGER = fix_logger(__name__)
# the watchdog's setting ``resume`` (read at apply()); off: the watchdog still fires, a restart starts as upstream does
RESUME = boolean("resume", "TRL_VLM_FIXES_WATCHDOG_RESUME", True)
USED_SUFFIX = ".resumed.txt"
_UNUSED = re.compile(r"trl_vlm_fixes_hang_rank(\d+)\.txt")
_STEP = re.compile(r" at step (\d+)\.")


def unused_reports(output_dir: str | os.PathLike[str] | None) -> dict[Path, str]:
    """Every rank's hang report in ``output_dir`` that no run has resumed after yet: path -> text."""
    found: dict[Path, str] = {}
    if not output_dir or not os.path.isdir(output_dir):
        return found
    for path in sorted(Path(output_dir).iterdir()):
        if _UNUSED.fullmatch(path.name):
            with contextlib.suppress(OSError):
                found[path] = path.read_text(errors="replace")
    return found


def hang_step(text: str) -> int | None:
    """The step a report names on its first line (``... on rank 1 at step 3.``), for the resume line."""
    match = _STEP.search(text.split("\n", 1)[0])
    return int(match.group(1)) if match else None


def _argument_value(field: Any) -> Any:
    """The ``resume_from_checkpoint`` field as ``train()`` takes it: a path, or True for the last checkpoint."""
    if isinstance(field, str) and field.strip().lower() in ("true", "yes", "1", "last"):
        return True
    if isinstance(field, str) and field.strip().lower() in ("false", "no", "0"):
        return False  # said explicitly: no resume, not even after a hang
    return field or None


def _resume_point(trainer: Any, reports: dict[Path, str]) -> Any:
    """What this rank's ``train()`` resumes from: the arguments' field, else a resumable checkpoint after a hang."""
    args = trainer.args
    from_arguments = _argument_value(getattr(args, "resume_from_checkpoint", None))
    if from_arguments is not None or not reports:
        return from_arguments
    output_dir = str(args.output_dir)
    if getattr(args, "save_on_each_node", False):  # node-local dirs: the nodes would decide differently
        LOGGER.warning(
            "the last run in %s ended by the watchdog, but save_on_each_node=True (output dirs may be "
            "node-local): not resuming on my own; pass resume_from_checkpoint to resume.",
            output_dir,
        )
        return None
    deepspeed = bool(getattr(trainer, "is_deepspeed_enabled", False))
    checkpoint, why_not = checkpoints.last_resumable(output_dir, int(getattr(args, "world_size", 1)), deepspeed)
    if trainer.is_world_process_zero():
        steps = sorted({step for step in map(hang_step, reports.values()) if step is not None})
        only_model = " (save_only_model=True saves the weights only)" if getattr(args, "save_only_model", False) else ""
        LOGGER.warning(
            "the last run in %s ended by the watchdog (hang at step %s: %s); %s (%s=0 to start fresh).",
            output_dir,
            ", ".join(map(str, steps)) or "?",
            ", ".join(path.name for path in reports),
            f"resuming from {checkpoint}"
            if checkpoint
            else f"no checkpoint can resume ({why_not}{only_model}): starting from step 0, as upstream does",
            RESUME.variable,
        )
    return checkpoint


def _reports_used(reports: dict[Path, str]) -> Any:
    """A callback: world process zero renames the reports at ``on_train_begin`` (every rank has read them then)."""
    from transformers import TrainerCallback

    class ReportsUsed(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            node_local = getattr(args, "save_on_each_node", False)  # each node's main process owns its node's dir
            if not (state.is_world_process_zero or (node_local and state.is_local_process_zero)):
                return
            for path in reports:
                try:
                    path.rename(path.with_name(path.name.removesuffix(".txt") + USED_SUFFIX))
                except FileNotFoundError:
                    continue  # a shared dir after all: another node's main process marked it
                except OSError as error:
                    LOGGER.warning("cannot mark %s as used (%s): a later start here would resume again.", path, error)

    return ReportsUsed()


def train_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Trainer.train`` of a GRPO/RLOO trainer: resume as described above when the caller named no checkpoint. The
    reports are marked used at training start whether or not it resumes (with resume off too): a later start there
    does not resume again."""
    if not is_rl_trainer(instance):
        return wrapped(*args, **kwargs)
    reports = unused_reports(getattr(instance.args, "output_dir", None))
    given = args[0] if args else kwargs.get("resume_from_checkpoint")
    if given is None and value("watchdog", RESUME.key):
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
    """The trainer's ``__init__``: its engine is built with the protection state of its ``output_dir``."""
    try:
        arguments = inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments.get("args")
    except TypeError:
        arguments = None
    with protection.building_in(getattr(arguments, "output_dir", None)):
        return wrapped(*args, **kwargs)


RESUME_TARGETS: tuple[Target, ...] = (
    Target("transformers.trainer", "Trainer.train", train_wrapper, required_parameters=("resume_from_checkpoint",)),
    *on_trainers({"__init__": init_wrapper}),
)
