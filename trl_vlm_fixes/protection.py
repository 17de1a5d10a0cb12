"""How much protection the engine being built needs, graded by the evidence of a hang: none known (each fix's
selected settings: vLLM's own CUDA graphs), the last run's engine made no progress (``ENGINE_HANG``), or it hung
again at the step it had hung at before (``REPEATED_HANG``). The watchdog answers from the hang reports in the
``output_dir`` of the trainer being built (it registers its answer when it is imported); the engine fixes ask here
and read what they declared for that level (``Fix.protected``). Neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from .logs import fix_logger

LOGGER = fix_logger(__name__)


class Level(IntEnum):
    """The protection an engine gets; a fix's protected settings apply from the level they are declared at up."""

    NO_HANG = 0  # no hang report in output_dir: the selected settings
    ENGINE_HANG = 1  # the last run ended with an engine that made no progress
    REPEATED_HANG = 2  # ... at the step where the run it restarted after had hung too (the same batch replayed)


@dataclass(frozen=True)
class Verdict:
    """The level, and why: the hang report it was read from (shown by the engine line, status and trainer start)."""

    level: Level = Level.NO_HANG
    reason: str = "no engine hang reported in output_dir"


NO_HANG = Verdict()
_answer: Callable[[str | None], Verdict] | None = None
# the output_dir of the trainer whose engine is being built (set by the watchdog around a trainer's __init__)
_building_output_dir: ContextVar[str | None] = ContextVar("trl_vlm_fixes_building_output_dir", default=None)


def register(answer: Callable[[str | None], Verdict]) -> None:
    """The watchdog's reading of the hang reports in an ``output_dir`` (None: no trainer known)."""
    global _answer
    _answer = answer


@contextmanager
def building_in(output_dir: Any) -> Iterator[None]:
    """Engines built inside this block belong to a trainer writing into ``output_dir``."""
    token = _building_output_dir.set(str(output_dir) if output_dir else None)
    try:
        yield
    finally:
        _building_output_dir.reset(token)


def due() -> Verdict:
    """The protection the engine being built needs (never raises: an unreadable answer is no hang)."""
    if _answer is None:
        return NO_HANG
    try:
        return _answer(_building_output_dir.get())
    except Exception as error:  # noqa: BLE001 - asking must never break an engine build
        LOGGER.warning("could not read the hang reports (%r): the selected settings", error)
        return NO_HANG


def setting(fix_name: str, key: str, selected: Any, level: int) -> Any:
    """A fix's setting for an engine at ``level``, read from its declaration (``Fix.protected``)."""
    from .registry import active

    return protected_setting(active().fixes[fix_name].protected, key, selected, level)


def protected_setting(declared: tuple[tuple[int, str, Any], ...], key: str, selected: Any, level: int) -> Any:
    """The value of setting ``key`` at ``level``: the one declared for the highest level up to ``level``, unless the
    selected value is at least as protective (declared at that level or above); else the selected value. A pinned
    value is kept where it protects enough, and never lowered."""
    values = sorted((at, value) for at, name, value in declared if name == key)
    reached = [(at, value) for at, value in values if at <= level]
    if not reached:
        return selected
    at, value = reached[-1]
    selected_rank = max((rank for rank, candidate in values if candidate == selected), default=0)
    return selected if selected_rank >= at else value
