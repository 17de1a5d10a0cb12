"""Which trainer owns a watched object (its VLLMGeneration, engine, server client): the report and the learned limits
take the rank, the step and ``output_dir`` from it, lazily. Weak on both sides: the watchdog never keeps a trainer
alive. An engine is registered when its trainer is built, after the build: the build's own sleep is not watched."""

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
        with contextlib.suppress(TypeError):  # not weak-referenceable: reports fall back to defaults
            if watched is not None:
                _trainers[watched] = weakref.proxy(trainer)


def trainer_of(watched: Any) -> Any | None:
    with contextlib.suppress(TypeError):
        return _trainers.get(watched)
    return None


def rank_and_output_dir(watched: Any) -> tuple[int, str | None]:
    """This process's rank, and the owning trainer's ``output_dir`` (None when no trainer is known)."""
    trainer = trainer_of(watched)
    rank = getattr(getattr(trainer, "accelerator", None), "process_index", None)
    output_dir = getattr(getattr(trainer, "args", None), "output_dir", None)
    return int(rank if rank is not None else os.environ.get("RANK", 0)), str(output_dir) if output_dir else None


def describe(what: str, watched: Any, likely_cause: str, watch: str) -> Callable[[], HangContext]:
    def build() -> HangContext:
        rank, output_dir = rank_and_output_dir(watched)
        step = getattr(getattr(trainer_of(watched), "state", None), "global_step", "?")
        return HangContext(what, rank, step, output_dir, engine_args.last_engine_settings, likely_cause, watch)

    return build
