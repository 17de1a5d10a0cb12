"""Should the engine being built drop its faster settings? After a hang repeated at one step, the watchdog says yes
(it registers its answer when it is imported); the engine fixes ask here and apply their declared protected settings.
Neither imports the other."""

from __future__ import annotations

from collections.abc import Callable

from .logs import fix_logger

LOGGER = fix_logger(__name__)
_answer: Callable[[], bool] | None = None


def register(answer: Callable[[], bool]) -> None:
    global _answer
    _answer = answer


def due() -> bool:
    """True when the last run in this trainer's ``output_dir`` ended in a repeated hang (never raises)."""
    if _answer is None:
        return False
    try:
        return bool(_answer())
    except Exception as error:  # noqa: BLE001 - asking must never break an engine build
        LOGGER.warning("could not read whether the last run hung twice at one step (%r): normal settings", error)
        return False
