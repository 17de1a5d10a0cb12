"""Does the installed vLLM take this engine argument, with this value? Asked of vLLM's own classes (``EngineArgs``,
``CompilationConfig``, ``CUDAGraphMode``) before an engine fix adds anything, so that an argument renamed or removed
in another vLLM release makes the fix step aside with one WARNING instead of breaking the user's engine build."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import typing
from typing import Any

from .versions import installed_version


def _vllm() -> str:
    return f"the installed vLLM ({installed_version('vllm')})"


def _choices(annotation: Any) -> set[Any] | None:
    """The values a ``Literal[...]`` annotation (possibly inside ``Optional``/``Union``) allows; None: not a Literal."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    found: set[Any] = set()
    literal = False
    for argument in typing.get_args(annotation):
        choices = _choices(argument)
        if choices is not None:
            literal = True
            found |= choices
    return found if literal else None


def _field_problem(owner: type, owner_name: str, name: str, value: Any) -> str | None:
    fields = {item.name: item for item in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
    if name not in fields:
        return f"{_vllm()} has no {owner_name} argument `{name}`"
    annotation = fields[name].type
    if isinstance(annotation, str):  # postponed annotations: resolve them, or check the name only
        try:
            annotation = typing.get_type_hints(owner).get(name, annotation)
        except Exception:  # noqa: BLE001 - an unresolvable annotation only loses the value check
            return None
    choices = _choices(annotation)
    if value is not None and choices is not None and value not in choices:
        allowed = ", ".join(sorted(map(str, choices)))
        return f"{_vllm()} does not accept {owner_name} `{name}={value}` (it takes {allowed})"
    return None


@functools.cache
def engine_argument_problem(name: str, value: Any = None) -> str | None:
    """Why ``LLM(..., name=value)`` would not work with the installed vLLM (read from its ``EngineArgs``), or None.
    Without vLLM there is nothing to build and nothing to check."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception as error:  # noqa: BLE001 - an unreadable vLLM is a reason to step aside, never a crash
        return f"cannot read vLLM's EngineArgs ({error!r})"
    return _field_problem(EngineArgs, "engine", name, value)


@functools.cache
def cudagraph_mode_problem(mode: str) -> str | None:
    """Why ``compilation_config={"cudagraph_mode": mode}`` would not work with the installed vLLM, or None."""
    if importlib.util.find_spec("vllm") is None:
        return None
    if problem := engine_argument_problem("compilation_config"):
        return problem
    try:
        from vllm.config import CompilationConfig, CUDAGraphMode
    except Exception as error:  # noqa: BLE001
        return f"cannot read vLLM's CompilationConfig ({error!r})"
    if problem := _field_problem(CompilationConfig, "compilation_config", "cudagraph_mode", None):
        return problem
    if mode not in CUDAGraphMode.__members__:
        return f"{_vllm()} has no CUDAGraphMode.{mode} (it has {', '.join(CUDAGraphMode.__members__)})"
    return None
