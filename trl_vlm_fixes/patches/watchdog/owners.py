"""Which trainer owns a watched object (its VLLMGeneration, engine, accelerator, optimizer): the hang report takes the
rank, the step and ``output_dir`` from it, lazily, only when a deadline passes. Weak on both sides: the watchdog never
keeps a trainer alive."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Any

from ... import engine_args
from .report import HangContext

_trainers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def remember(trainer: Any, *objects: Any) -> None:
    for watched in objects:
        with contextlib.suppress(TypeError):  # not hashable or not weak-referenceable: reports fall back to defaults
            if watched is not None and watched not in _trainers:
                _trainers[watched] = weakref.proxy(trainer)


def trainer_of(watched: Any) -> Any | None:
    with contextlib.suppress(TypeError):
        return _trainers.get(watched)
    return None


def describe(what: str, watched: Any, likely_cause: str) -> Callable[[], HangContext]:
    def build() -> HangContext:
        trainer = trainer_of(watched)
        state = getattr(trainer, "state", None)
        args = getattr(trainer, "args", None)
        accelerator = next(
            (a for a in (watched, getattr(watched, "accelerator", None), getattr(trainer, "accelerator", None))
             if getattr(a, "process_index", None) is not None),
            None,
        )
        rank = getattr(accelerator, "process_index", None)
        return HangContext(
            what=what,
            rank=int(rank if rank is not None else os.environ.get("RANK", 0)),
            step=getattr(state, "global_step", "?"),
            output_dir=str(getattr(args, "output_dir", None) or "."),
            engine_settings=engine_args.last_engine_settings,
            likely_cause=likely_cause,
        )

    return build
