"""Bind a wrapped TRL call's arguments by name, so a wrapper never relies on argument positions (ddtrace's lesson)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

_signatures: dict[Any, inspect.Signature] = {}


def bind(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """``wrapped(*args, **kwargs)``'s arguments by name; the signature is read once per function (a hot path)."""
    function = getattr(wrapped, "__func__", wrapped)
    signature = _signatures.get(function)
    if signature is None:
        signature = inspect.signature(wrapped)
        _signatures[function] = signature
    return signature.bind(*args, **kwargs)
