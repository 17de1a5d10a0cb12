"""The rollout watchdog's timer: one shared thread per process, plus a C-level backstop set at every arm.

A wedged vLLM generate (GPU at 100%, CPU idle, SIGTERM ignored: the main thread never returns to Python, so Python
signal handlers never run) burns GPU hours until someone notices. When an armed deadline passes, the timer thread
reports (``report.py``) and ends the process with exit code 75 (EX_TEMPFAIL), so torchrun, accelerate or SLURM
restart logic takes over. That thread needs the GIL; so ``arm()`` also sets, before it returns, kernel timers that
end the process with 75 ten seconds later without Python (``backstop.py``). Nothing runs until the first arm.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from .report import EXIT_CODE, HangContext, fire

if TYPE_CHECKING:
    from .backstop import Backstop

__all__ = ["EXIT_CODE", "WATCHDOG", "HangContext", "Watchdog"]
LOGGER = logging.getLogger("trl_vlm_fixes")


class Watchdog:
    def __init__(self) -> None:
        self._next_token = 0
        self._reset()
        _INSTANCES.add(self)

    def _reset(self) -> None:
        """Fresh state (also in a forked child: it inherits neither the thread, the timers nor a free lock)."""
        self._condition = threading.Condition()
        self._armed: dict[int, tuple[float, float, Callable[[], HangContext]]] = {}
        self._thread: threading.Thread | None = None
        self._backstop: Backstop | None = None
        self._firing = False

    def arm(self, seconds: float, context: Callable[[], HangContext]) -> int:
        """Returns once the deadline is set both in Python and in the kernel (the backstop)."""
        with self._condition:
            token = self._next_token
            self._next_token += 1
            self._armed[token] = (time.monotonic() + seconds, seconds, context)
            if self._thread is None:
                self._start()
            self._sync_backstop()
            self._condition.notify()
        return token

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
        """The kernel timers follow the earliest armed deadline; cleared when nothing is armed."""
        if self._backstop is None or self._firing:
            return  # once firing, nothing may take the backstop away
        if self._armed:
            self._backstop.set(min(entry[0] for entry in self._armed.values()) - time.monotonic())
        else:
            self._backstop.clear()

    def _run(self) -> None:
        with self._condition:
            while True:
                if not self._armed:
                    self._condition.wait()
                    continue
                deadline, seconds, context = min(self._armed.values(), key=lambda entry: entry[0])
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._condition.wait(remaining)
                    continue
                self._firing = True
                break
        fire(seconds, context)


_INSTANCES: weakref.WeakSet[Watchdog] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for dog in list(_INSTANCES):
        dog._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

WATCHDOG = Watchdog()
