"""The watchdog's timer: one thread per process, and the kernel backstop moved with every deadline.

A wedged CUDA kernel keeps the main thread in C: signal handlers never run, SIGTERM does nothing. When a deadline
passes, the thread reports and exits 75 (``report.py``); it needs the GIL, so ``arm()`` also sets kernel timers that
end the process without Python (``backstop.py``) before it returns. Watches are independent (a push and the wake-up
inside it each keep their own deadline). ``progress()`` gives a watch its allowance again and moves the kernel timers
at most every ``BACKSTOP_REFRESH_SECONDS`` (a decode step comes every few ms). Nothing runs until the first arm.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .report import EXIT_CODE, HangContext, fire

if TYPE_CHECKING:
    from .backstop import Backstop

__all__ = ["EXIT_CODE", "WATCHDOG", "HangContext", "Watchdog"]
BACKSTOP_REFRESH_SECONDS = 0.25


@dataclass
class _Watch:
    deadline: float
    seconds: float  # the allowance, given again by each progress()
    context: Callable[[], HangContext]


class Watchdog:
    def __init__(self) -> None:
        self._next_token = 0
        self._reset()
        _INSTANCES.add(self)

    def _reset(self) -> None:
        """Fresh state (also in a forked child: it inherits neither the thread, the timers nor a free lock)."""
        self._condition = threading.Condition()
        self._armed: dict[int, _Watch] = {}
        self._thread: threading.Thread | None = None
        self._backstop: Backstop | None = None
        self._firing = False
        self._backstop_due = 0.0

    def arm(self, seconds: float, context: Callable[[], HangContext]) -> int:
        """Hung ``seconds`` from now (or from the last ``progress``); returns once that is set in Python and in the
        kernel."""
        with self._condition:
            token = self._next_token
            self._next_token += 1
            self._armed[token] = _Watch(time.monotonic() + seconds, seconds, context)
            if self._thread is None:
                self._start()
            self._sync_backstop()
            self._condition.notify()
        return token

    def progress(self, token: int) -> None:
        """The watched call moved on: its allowance starts again. The thread is not woken (a deadline that only moves
        later is found when it wakes)."""
        with self._condition:
            watch = self._armed.get(token)
            if watch is None:
                return
            now = time.monotonic()
            watch.deadline = now + watch.seconds
            if now >= self._backstop_due:
                self._sync_backstop()

    def disarm(self, token: int) -> None:
        with self._condition:
            if self._armed.pop(token, None) is not None:
                self._sync_backstop()

    def _start(self) -> None:
        from .backstop import make_backstop  # ctypes only once something is armed

        thread = threading.Thread(target=self._run, name="trl_vlm_fixes-watchdog", daemon=True)
        thread.start()
        self._thread = thread
        self._backstop = make_backstop(thread.native_id or 0)

    def _sync_backstop(self) -> None:
        """The kernel timers follow the earliest deadline; cleared when nothing is armed, never once firing."""
        if self._backstop is None or self._firing:
            return
        now = time.monotonic()
        self._backstop_due = now + BACKSTOP_REFRESH_SECONDS
        if self._armed:
            self._backstop.set(min(watch.deadline for watch in self._armed.values()) - now)
        else:
            self._backstop.clear()

    def _run(self) -> None:
        with self._condition:
            while True:
                watch = min(self._armed.values(), key=lambda entry: entry.deadline, default=None)
                remaining = watch.deadline - time.monotonic() if watch else None
                if watch is None or (remaining is not None and remaining > 0):
                    self._condition.wait(remaining)
                    continue
                self._firing = True
                break
        fire(watch.seconds, watch.context)


_INSTANCES: weakref.WeakSet[Watchdog] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for dog in list(_INSTANCES):
        dog._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

WATCHDOG = Watchdog()
