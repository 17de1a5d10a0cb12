"""State a fix keeps about an object it does not own (a trainer, a VLLMGeneration, an engine), one mechanism for all.

Kept beside the object, weakly keyed: nothing is set on TRL's objects (``revert()`` leaves nothing behind) and the
state dies with its owner. An owner that cannot be weakly referenced or hashed gets no stored state: ``get`` says
None and ``setdefault`` hands out a fresh value each time, so such an owner loses only the memory, never a call.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class OwnerState(Generic[T]):
    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._states: weakref.WeakKeyDictionary[Any, T] = weakref.WeakKeyDictionary()

    def get(self, owner: Any) -> T | None:
        try:
            return self._states.get(owner)
        except TypeError:
            return None

    def setdefault(self, owner: Any) -> T:
        try:
            state = self._states.get(owner)
            if state is None:
                state = self._states[owner] = self._factory()
            return state
        except TypeError:
            return self._factory()

    def set(self, owner: Any, state: T) -> None:
        with contextlib.suppress(TypeError):
            self._states[owner] = state

    def pop(self, owner: Any) -> T | None:
        try:
            return self._states.pop(owner, None)
        except TypeError:
            return None
