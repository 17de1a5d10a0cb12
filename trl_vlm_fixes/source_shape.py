"""Structural checks of TRL's source (AST), so that a change of quotes, spacing or line breaks never flips a verdict.

The fixes use these to decide whether their target still has the shape they rely on, or whether upstream already
solved the bug. A function whose source cannot be read gives ``None``: the callers then say so instead of guessing.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable
from typing import Any


def function_tree(function: Callable[..., Any]) -> ast.AST | None:
    """The parsed source of ``function`` (unwrapped), or None where no source is available.

    Parsed once per code object: several targets check the same TRL method at import time, and each parse costs
    tens of milliseconds there (measured: 8 parses were 0.4 s of the plugin's import next to vLLM).
    """
    function = inspect.unwrap(getattr(function, "__func__", function))
    code = getattr(function, "__code__", None)
    if code is None:
        return _parse(function)
    return _parse_code(code, function)


@functools.lru_cache(maxsize=64)
def _parse_code(code: Any, function: Callable[..., Any]) -> ast.AST | None:
    return _parse(function)


def _parse(function: Callable[..., Any]) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def calls_method(tree: ast.AST, method: str, first_argument: str | None = None, keyword: str | None = None) -> bool:
    """Does ``tree`` call ``<anything>.method(...)``, with a string constant ``first_argument`` and passing
    ``keyword=`` when given?"""
    for call in _calls(tree):
        if not (isinstance(call.func, ast.Attribute) and call.func.attr == method):
            continue
        if keyword is not None and not any(k.arg == keyword for k in call.keywords):
            continue
        if first_argument is None:
            return True
        first = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "method"), None)
        if isinstance(first, ast.Constant) and first.value == first_argument:
            return True
    return False


def calls_name(tree: ast.AST, name: str) -> bool:
    """Does ``tree`` call the bare name ``name(...)`` (a module global such as ``LLM``)?"""
    return any(isinstance(call.func, ast.Name) and call.func.id == name for call in _calls(tree))


def string_constants(tree: ast.AST) -> set[str]:
    """Every string constant in ``tree`` (dictionary keys such as ``"prompt_token_ids"`` among them)."""
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
