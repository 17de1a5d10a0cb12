"""The rollout watchdog's mechanism: one shared timer thread per process, arm/disarm in microseconds.

A wedged vLLM generate (GPU at 100%, CPU idle, SIGTERM ignored: the main thread never returns to Python, so Python
signal handlers never run) burns GPU hours until someone notices. When an armed deadline passes, the timer thread
writes every thread's stack and what it knows to stderr and to ``trl_vlm_fixes_hang_rank{N}.txt``, logs how to resume,
and ends the process with exit code 75 (EX_TEMPFAIL), with a SIGKILL from a detached helper 10 s later if it is still
alive, so torchrun, accelerate or SLURM restart logic takes over. Nothing runs until the first arm.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

LOGGER = logging.getLogger("trl_vlm_fixes")
EXIT_CODE = 75  # EX_TEMPFAIL: "try again", what restart logic should see
KILL_AFTER_SECONDS = 10


@dataclass
class HangContext:
    """What the report says about the call that hung (filled in lazily, only when it fires)."""

    what: str
    rank: int
    step: Any
    output_dir: str
    engine_settings: str
    likely_cause: str


class Watchdog:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._armed: dict[int, tuple[float, float, Callable[[], HangContext]]] = {}
        self._next_token = 0
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, context: Callable[[], HangContext]) -> int:
        with self._condition:
            token = self._next_token
            self._next_token += 1
            self._armed[token] = (time.monotonic() + seconds, seconds, context)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trl_vlm_fixes-watchdog", daemon=True)
                self._thread.start()
            self._condition.notify()
        return token

    def disarm(self, token: int) -> None:
        with self._condition:
            self._armed.pop(token, None)

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
                break
        fire(seconds, context())


WATCHDOG = Watchdog()


def _stacks_with_qualified_names() -> str:
    """Every thread's Python stack, innermost last, as ``module:Class.function (file:line)``."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        lines.append(f"Thread {names.get(ident, ident)}:")
        stack = []
        current: Any = frame
        while current is not None:
            code = current.f_code
            qualname = getattr(code, "co_qualname", code.co_name)
            module = current.f_globals.get("__name__", "?")
            stack.append(f"  {module}:{qualname} ({code.co_filename}:{current.f_lineno})")
            current = current.f_back
        lines.extend(reversed(stack))
    return "\n".join(lines)


def hang_report(seconds: float, context: HangContext) -> str:
    return "\n".join(
        [
            f"trl_vlm_fixes rollout watchdog: {context.what} ran longer than {seconds:g} s "
            f"(TRL_VLM_FIXES_WATCHDOG) on rank {context.rank} at step {context.step}.",
            f"engine: {context.engine_settings}",
            f"likely cause: {context.likely_cause}",
            f"resume: restart the job with resume_from_checkpoint (the process exits with {EXIT_CODE}, EX_TEMPFAIL).",
            "",
            "Python stacks (qualified names):",
            _stacks_with_qualified_names(),
            "",
            "faulthandler:",
        ]
    )


def _write(stream: TextIO, report: str) -> None:
    stream.write(report + "\n")
    stream.flush()
    faulthandler.dump_traceback(file=stream, all_threads=True)
    stream.flush()


def fire(seconds: float, context: HangContext) -> None:
    """Report, then end the process (75), with a SIGKILL 10 s later from outside if it is still alive."""
    report = hang_report(seconds, context)
    path = Path(context.output_dir or ".") / f"trl_vlm_fixes_hang_rank{context.rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            _write(handle, report)
    except OSError as error:
        path = Path(f"(not written: {error})")
    with contextlib.suppress(OSError, ValueError):
        _write(sys.stderr, report)
    LOGGER.error(
        "trl_vlm_fixes: %s hung for %g s on rank %s at step %s; stacks in %s. Ending the process with exit code %d so "
        "restart logic takes over: restart with resume_from_checkpoint. Likely cause: %s",
        context.what,
        seconds,
        context.rank,
        context.step,
        path,
        EXIT_CODE,
        context.likely_cause,
    )
    for handler in logging.getLogger().handlers + LOGGER.handlers:
        with contextlib.suppress(Exception):  # a broken handler must not keep a hung process alive
            handler.flush()
    _kill_later(os.getpid())
    os._exit(EXIT_CODE)


def _kill_later(pid: int) -> None:
    """A detached helper SIGKILLs us if exiting itself hangs (a process stuck in the GPU driver)."""
    with contextlib.suppress(OSError):
        subprocess.Popen(
            ["/bin/sh", "-c", f"sleep {KILL_AFTER_SECONDS}; kill -0 {pid} 2>/dev/null && kill -9 {pid}"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
