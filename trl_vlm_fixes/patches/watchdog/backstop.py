"""The kernel backstop: timers set with every deadline, so the process ends even where Python cannot run.

The timer thread needs the GIL, its report needs stderr and the filesystem: a C call holding the GIL, a hung network
filesystem or a full stderr pipe would keep it from ending the process. So every deadline also sets two POSIX timers
(CLOCK_MONOTONIC), before the watched call starts:

- deadline + ``STACKS_AFTER_SECONDS``: a signal to the watchdog thread, on which faulthandler (C, no GIL) writes every
  thread's stack to the stderr saved at the first arm;
- deadline + ``EXIT_AFTER_SECONDS``: glibc starts a thread that calls ``_exit(75)`` (SIGEV_THREAD passes the timer's
  value, 75): no GIL, no Python, no filesystem, no stderr.

When Python can run, ``report.fire`` exits first and neither fires; the last disarm clears both. Without POSIX timers
(not Linux), faulthandler's own timer is the backstop and exits with its code, 1 (a WARNING says so).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
from typing import Any, Protocol

from ...logs import fix_logger
from .report import EXIT_CODE, saved_stderr

LOGGER = fix_logger(__name__)
STACKS_AFTER_SECONDS = 5.0  # after the deadline: report.fire is done by then when Python can run
EXIT_AFTER_SECONDS = 10.0
# a real-time signal nobody uses by default; taken only while its handler is still the default one
STACKS_SIGNAL: int | None = signal.SIGRTMIN + 9 if hasattr(signal, "SIGRTMIN") else None
_CLOCK_MONOTONIC, _SIGEV_THREAD, _SIGEV_THREAD_ID = 1, 2, 4


class Backstop(Protocol):
    def set(self, seconds: float) -> None: ...  # fire ``seconds`` from now plus the delays (replaces the last set)

    def clear(self) -> None: ...


def make_backstop(thread_id: int) -> Backstop:
    try:
        return _PosixTimers(thread_id, saved_stderr())
    except Exception as error:  # noqa: BLE001 - no POSIX timers here (not Linux, a sandbox): the fallback still ends it
        LOGGER.warning(
            "the C-level backstop uses faulthandler here (%s): a hang that holds the GIL ends the process "
            "with exit code 1 instead of %d.",
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
    """Two timers made once per watchdog; each set or clear is two ``timer_settime`` calls (about 1 us each)."""

    def __init__(self, thread_id: int, fd: int) -> None:
        # PyDLL keeps the GIL over these non-blocking syscalls (CDLL would hand it to the woken thread at every arm);
        # POSIX timers are in libc since glibc 2.34, in librt before
        libc = ctypes.PyDLL(None, use_errno=True)
        libc = libc if hasattr(libc, "timer_create") else ctypes.PyDLL("librt.so.1", use_errno=True)
        self._settime = libc.timer_settime
        self._settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._spec = (ctypes.c_long * 4)()  # struct itimerspec: interval (s, ns), then value (s, ns)
        self._spec_address = ctypes.addressof(self._spec)
        exit_event = _Sigevent(notify=_SIGEV_THREAD)
        exit_event.value.integer = EXIT_CODE  # the argument _exit gets
        exit_event.target.thread.function = ctypes.cast(ctypes.CDLL(None)._exit, ctypes.c_void_p)
        self._exit_timer = _create(libc, exit_event)
        self._stacks_timer: Any = None
        try:
            if STACKS_SIGNAL is None or signal.getsignal(STACKS_SIGNAL) != signal.SIG_DFL:
                raise OSError("no free signal")
            faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True)
            stacks_event = _Sigevent(signo=STACKS_SIGNAL, notify=_SIGEV_THREAD_ID)
            stacks_event.target.thread_id = thread_id  # the watchdog thread: the hung call is not interrupted
            self._stacks_timer = _create(libc, stacks_event)
        except OSError as error:
            LOGGER.warning(
                "no C-level stack dump (%s): a hang that holds the GIL still ends with exit 75, without its stacks.",
                error,
            )

    def set(self, seconds: float) -> None:
        self._after(self._stacks_timer, max(seconds + STACKS_AFTER_SECONDS, 0.001))  # 0 would disarm it
        self._after(self._exit_timer, max(seconds + EXIT_AFTER_SECONDS, 0.001))

    def clear(self) -> None:
        self._after(self._stacks_timer, 0.0)
        self._after(self._exit_timer, 0.0)

    def _after(self, timer: Any, seconds: float) -> None:
        if timer is not None:
            self._spec[2], self._spec[3] = int(seconds), int((seconds % 1) * 1e9)
            self._settime(timer, 0, self._spec_address, None)


def _create(libc: Any, event: _Sigevent) -> ctypes.c_void_p:
    timer = ctypes.c_void_p()
    if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"timer_create: {os.strerror(error)}")
    return timer
