"""One WARNING per occasion and process: a fix stepping aside, or a token seen, is news once, not at every step."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

LOGGER = logging.getLogger("trl_vlm_fixes")

_said: set[Hashable] = set()


def warn_once(key: Hashable, message: str, *args: Any) -> None:
    """Log ``message % args`` at WARNING the first time ``key`` is seen in this process."""
    if key not in _said:
        _said.add(key)
        LOGGER.warning(message, *args)
