"""The rollout watchdog's timer: one shared thread per process, plus a C-level backstop set at every arm.

A wedged vLLM generate (GPU at 100%, CPU idle, SIGTERM ignored: the main thread never returns to Python, so Python
signal handlers never run) burns GPU hours until someone notices. When an armed deadline passes, the timer thread
reports (``report.py``) and ends the process with exit code 75 (EX_TEMPFAIL), so torchrun, accelerate or SLURM
restart logic takes over. That thread needs the GIL; so ``arm()`` also sets, before it returns, kernel timers that
end the process with 75 ten seconds later without Python (``backstop.py``). Nothing runs until the first arm.

Watches nest per thread: the innermost armed call is the one watched (a ``sync_weights`` inside a generate has its own
limit, which may be longer than the generate's); the outer one's clock is stopped meanwhile and restarts, in full,
when the inner one returns. ``progress(token)`` restarts a watch's clock (a colocated engine step that returned); it
moves the kernel timers at most every ``BACKSTOP_REFRESH_SECONDS`` (each ``timer_settime`` through ctypes costs a few
us, a decode step comes every few ms), so they may lag the Python deadline by that much: the backstop's stacks and
exit come at least 4.75 s and 9.75 s after the deadline instead of 5 s and 10 s.
"""

from __future__ import annotations

import logging
import math
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
LOGGER = logging.getLogger("trl_vlm_fixes")
BACKSTOP_REFRESH_SECONDS = 0.25


@dataclass
class _Watch:
    deadline: float  # math.inf while an inner watch of the same thread is armed
    seconds: float
    context: Callable[[], HangContext]
    thread: int


class Watchdog:
    def __init__(self) -> None:
        self._next_token = 0
        self._reset()
        _INSTANCES.add(self)

    def _reset(self) -> None:
        """Fresh state (also in a forked child: it inherits neither the thread, the timers nor a free lock)."""
        self._condition = threading.Condition()
        self._armed: dict[int, _Watch] = {}
        self._stacks: dict[int, list[int]] = {}  # thread -> its armed tokens, innermost last
        self._thread: threading.Thread | None = None
        self._backstop: Backstop | None = None
        self._firing = False
        self._backstop_due = 0.0  # progress() moves the kernel timers again from then on

    def arm(self, seconds: float, context: Callable[[], HangContext]) -> int:
        """Returns once the deadline is set both in Python and in the kernel (the backstop)."""
        thread = threading.get_ident()
        with self._condition:
            token = self._next_token
            self._next_token += 1
            stack = self._stacks.setdefault(thread, [])
            if stack:  # the inner call is watched now; the outer one waits for it
                self._armed[stack[-1]].deadline = math.inf
            stack.append(token)
            self._armed[token] = _Watch(time.monotonic() + seconds, seconds, context, thread)
            if self._thread is None:
                self._start()
            self._sync_backstop()
            self._condition.notify()
        return token

    def progress(self, token: int) -> None:
        """The watched call made progress: its full limit starts again. The thread is not woken (the deadline only
        moves later: it finds out when it wakes); the kernel timers follow at most every BACKSTOP_REFRESH_SECONDS."""
        with self._condition:
            watch = self._armed.get(token)
            if watch is None or watch.deadline == math.inf:
                return
            now = time.monotonic()
            watch.deadline = now + watch.seconds
            if now >= self._backstop_due:
                self._sync_backstop()

    def disarm(self, token: int) -> None:
        with self._condition:
            watch = self._armed.pop(token, None)
            if watch is None:
                return
            stack = self._stacks.get(watch.thread, [])
            innermost = bool(stack) and stack[-1] == token
            if token in stack:
                stack.remove(token)
            if not stack:
                self._stacks.pop(watch.thread, None)
            elif innermost:  # the outer call's clock restarts in full
                outer = self._armed[stack[-1]]
                outer.deadline = time.monotonic() + outer.seconds
                self._condition.notify()
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
        now = time.monotonic()
        self._backstop_due = now + BACKSTOP_REFRESH_SECONDS
        if self._armed:
            self._backstop.set(min(watch.deadline for watch in self._armed.values()) - now)
        else:
            self._backstop.clear()

    def _run(self) -> None:
        with self._condition:
            while True:
                if not self._armed:
                    self._condition.wait()
                    continue
                watch = min(self._armed.values(), key=lambda entry: entry.deadline)
                remaining = watch.deadline - time.monotonic()
                if remaining > 0:
                    self._condition.wait(remaining if remaining != math.inf else None)
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
