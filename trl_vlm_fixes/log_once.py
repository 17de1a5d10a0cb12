"""One log line per occasion and process: a fix stepping aside, or a token seen, is news once, not at every step."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

_CORE = logging.getLogger("trl_vlm_fixes")
_said: set[Hashable] = set()


def warn_once(key: Hashable, message: str, *args: Any, logger: Any = None, level: int = logging.WARNING) -> None:
    """Log ``message % args`` (at WARNING unless told) the first time ``key`` is seen in this process, on the fix's
    logger (``logs.fix_logger``: its prefix is added there)."""
    if key not in _said:
        _said.add(key)
        (logger or _CORE).log(level, message, *args)


def forget() -> None:
    """Nothing said yet (the tests: each starts from a fresh process's state)."""
    _said.clear()
