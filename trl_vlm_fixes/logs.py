"""One logger per module, a child of ``trl_vlm_fixes``, and one message prefix: ``trl_vlm_fixes.<fix>: `` for a fix's
modules, ``trl_vlm_fixes: `` for the core, so a line always says who wrote it without anyone typing it."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any


class _Prefixed(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self.extra['prefix'] if self.extra else ''}: {msg}", kwargs


def message_prefix(module_name: str) -> str:
    """``trl_vlm_fixes.patches.mm_realign.realign`` -> ``trl_vlm_fixes.mm_realign``; the core -> ``trl_vlm_fixes``."""
    parts = module_name.split(".")
    return f"trl_vlm_fixes.{parts[2]}" if len(parts) > 2 and parts[1] == "patches" else "trl_vlm_fixes"


def fix_logger(module_name: str) -> logging.LoggerAdapter:  # type: ignore[type-arg]
    """The logger of ``module_name`` (pass ``__name__``), its messages prefixed."""
    return _Prefixed(logging.getLogger(module_name), {"prefix": message_prefix(module_name)})
