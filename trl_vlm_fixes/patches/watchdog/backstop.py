"""The watchdog's C-level backstop: kernel timers set at every arm, so the process ends even where Python cannot run.

The timer thread in ``timer.py`` needs the GIL, and its report needs stderr and the filesystem: a hang inside a C call
that holds the GIL, a hung network filesystem or a full stderr pipe would keep it from ever ending the process. So
``arm()`` sets two POSIX timers (CLOCK_MONOTONIC) before it returns, that is before the call that may hang starts:

- deadline + ``STACKS_AFTER_SECONDS``: a signal to the watchdog thread, on which faulthandler (C code, no GIL needed)
  writes every thread's Python stack to the stderr saved at the first arm;
- deadline + ``EXIT_AFTER_SECONDS``: glibc starts a thread that calls ``_exit(75)`` (SIGEV_THREAD calls the function
  with the timer's value, 75, as its argument): no GIL, no Python, no filesystem, no stderr.

When Python can run, ``report.fire`` exits first (within a few seconds of the deadline) and neither timer fires; the
last disarm clears both. Where POSIX timers are missing (not Linux), faulthandler's own timer is the backstop: it
writes the stacks and exits with faulthandler's code, 1, not 75 (it has no other).
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
from typing import Any, Protocol

from .report import EXIT_CODE, saved_stderr

LOGGER = logging.getLogger("trl_vlm_fixes")
STACKS_AFTER_SECONDS = 5.0  # after the deadline: report.fire is done by then when Python can run
EXIT_AFTER_SECONDS = 10.0
# a real-time signal nobody uses by default; taken only while its handler is still the default one
STACKS_SIGNAL: int | None = signal.SIGRTMIN + 9 if hasattr(signal, "SIGRTMIN") else None

_CLOCK_MONOTONIC = 1
_SIGEV_THREAD = 2
_SIGEV_THREAD_ID = 4


class Backstop(Protocol):
    def set(self, seconds: float) -> None:
        """Fire ``seconds`` from now plus the backstop's delays (replaces the previous setting)."""

    def clear(self) -> None:
        """Nothing is armed any more."""


def make_backstop(thread_id: int) -> Backstop:
    """POSIX timers where the C library has them (Linux), else faulthandler's timer (exit code 1)."""
    try:
        return _PosixTimers(thread_id, saved_stderr())
    except Exception as error:  # noqa: BLE001 - no POSIX timers here (not Linux, a sandbox): the fallback still ends it
        LOGGER.warning(
            "trl_vlm_fixes: the rollout watchdog's C-level backstop uses faulthandler here (%s): a hang that holds "
            "the GIL ends the process with exit code 1 instead of %d.",
            error,
            EXIT_CODE,
        )
        return _FaulthandlerTimer(saved_stderr())


class _FaulthandlerTimer:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def set(self, seconds: float) -> None:
        faulthandler.dump_traceback_later(max(seconds, 0) + EXIT_AFTER_SECONDS, exit=True, file=self._fd)

    def clear(self) -> None:
        faulthandler.cancel_dump_traceback_later()


class _Value(ctypes.Union):
    _fields_ = [("integer", ctypes.c_int), ("pointer", ctypes.c_void_p)]


class _ThreadNotify(ctypes.Structure):
    _fields_ = [("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p)]


class _Target(ctypes.Union):
    _fields_ = [("thread_id", ctypes.c_int), ("thread", _ThreadNotify), ("_pad", ctypes.c_int * 12)]


class _Sigevent(ctypes.Structure):
    """``struct sigevent`` as Linux lays it out (64 bytes): value, signal, notify, then a thread id or a function."""

    _fields_ = [("value", _Value), ("signo", ctypes.c_int), ("notify", ctypes.c_int), ("target", _Target)]


class _PosixTimers:
    """Two timers made once per watchdog; each arm and disarm costs two ``timer_settime`` calls (about 1 us each)."""

    def __init__(self, thread_id: int, fd: int) -> None:
        libc = _timer_library()
        self._settime = libc.timer_settime
        self._settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._spec = (ctypes.c_long * 4)()  # struct itimerspec: interval (s, ns), then value (s, ns)
        self._spec_address = ctypes.addressof(self._spec)
        exit_event = _Sigevent()
        exit_event.notify = _SIGEV_THREAD
        exit_event.value.integer = EXIT_CODE  # the argument _exit gets
        exit_event.target.thread.function = ctypes.cast(ctypes.CDLL(None)._exit, ctypes.c_void_p)
        self._exit_timer = _create(libc, exit_event)
        self._stacks_timer: Any = None
        if STACKS_SIGNAL is None or signal.getsignal(STACKS_SIGNAL) != signal.SIG_DFL:
            LOGGER.warning(
                "trl_vlm_fixes.watchdog: no free signal for the C-level stack dump; a hang that holds the GIL still "
                "ends with exit 75, without its stacks."
            )
        else:
            faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True)
            stacks_event = _Sigevent()
            stacks_event.notify = _SIGEV_THREAD_ID  # to the watchdog thread: the hung thread's call is not interrupted
            stacks_event.signo = STACKS_SIGNAL
            stacks_event.target.thread_id = thread_id
            try:
                self._stacks_timer = _create(libc, stacks_event)
            except OSError as error:
                LOGGER.warning(
                    "trl_vlm_fixes.watchdog: the C-level stack dump timer could not be created (%s); a hang that holds "
                    "the GIL still ends with exit 75, without its stacks.",
                    error,
                )

    def set(self, seconds: float) -> None:
        self._after(self._stacks_timer, max(seconds + STACKS_AFTER_SECONDS, 0.001))  # 0 would disarm it
        self._after(self._exit_timer, max(seconds + EXIT_AFTER_SECONDS, 0.001))

    def clear(self) -> None:
        self._after(self._stacks_timer, 0.0)
        self._after(self._exit_timer, 0.0)

    def _after(self, timer: Any, seconds: float) -> None:
        if timer is None:
            return
        self._spec[2] = int(seconds)
        self._spec[3] = int((seconds % 1) * 1e9)
        self._settime(timer, 0, self._spec_address, None)


def _timer_library() -> Any:
    """The C library's POSIX timers: in libc since glibc 2.34, in librt before.

    Loaded as PyDLL, which keeps the GIL over each call (syscalls that never block): a CDLL call would hand the GIL to
    the woken watchdog thread at every arm (8 us instead of 23 us per arm and disarm).
    """
    libc = ctypes.PyDLL(None, use_errno=True)
    if not hasattr(libc, "timer_create"):
        libc = ctypes.PyDLL("librt.so.1", use_errno=True)
    return libc


def _create(libc: Any, event: _Sigevent) -> ctypes.c_void_p:
    timer = ctypes.c_void_p()
    if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"timer_create: {os.strerror(error)}")
    return timer
