"""What the watchdog does when a deadline passes and Python can run: record the hang, report it, then exit 75.

First the protection state in ``output_dir`` records the hang (``escalation.py``: what the next engine there is built
with), then stderr and the report file (diagnosis; a restart resumes after it, ``resume.py``), then logging. Each
output runs in a thread of its own within a time budget, its exceptions swallowed: ``sys.stderr = None``, a tee without
``fileno``, a hung filesystem or a full stderr pipe cost a few seconds, never the exit. stderr is a private copy of fd
2 taken at the first arm. Where even this cannot run (a C call holding the GIL), the kernel backstop (``backstop.py``)
ends the process and nothing is recorded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from . import escalation

LOGGER = logging.getLogger("trl_vlm_fixes")
EXIT_CODE = 75  # EX_TEMPFAIL: "try again", what restart logic should see
STATE_BUDGET_SECONDS = 2.0  # the protection state, first: the restart's engine depends on it
WRITE_BUDGET_SECONDS = 2.0  # stderr and the report file, written side by side
LOG_BUDGET_SECONDS = 1.0  # all three well before the kernel backstop's exit (backstop.EXIT_AFTER_SECONDS)
ENGINE_STEP = "engine-step"  # the colocated engine's progress rule, as the report's ``watch:`` line names it
_saved_stderr: int | None = None


@dataclass
class HangContext:
    """What the report says about the call that hung (filled in lazily, only when it fires)."""

    what: str
    rank: int
    step: Any
    output_dir: str | None  # None: no trainer known, the report goes to stderr only
    engine_settings: str
    likely_cause: str
    watch: str = "other"  # which rule fired: ENGINE_STEP, or a total-time phase's key


def saved_stderr() -> int:
    """A private copy of fd 2, taken at the first arm: it outlives ``sys.stderr = None``, a tee, a closed fd 2."""
    global _saved_stderr
    if _saved_stderr is None:
        try:
            _saved_stderr = os.dup(2)
        except OSError:
            _saved_stderr = os.open(os.devnull, os.O_WRONLY)
    return _saved_stderr


def fire(seconds: float, describe: Callable[[], HangContext]) -> NoReturn:
    """Record the hang, report it (each output bounded in time), then end the process with exit code 75."""
    context = _describe(describe)
    recorded: list[list[str]] = []

    def record() -> None:
        try:
            recorded.append(escalation.record(context.watch, context.step, context.rank, context.output_dir))
        except Exception as error:  # noqa: BLE001 - the report must still say so, and the process still end
            recorded.append(escalation.not_recorded(repr(error)))

    _within(STATE_BUDGET_SECONDS, [record])
    notes = recorded[0] if recorded else escalation.not_recorded(f"the write took over {STATE_BUDGET_SECONDS:g} s")
    report = hang_report(seconds, context, notes)
    written: list[Path] = []

    def write_file() -> None:
        if context.output_dir is None:
            return
        path = Path(context.output_dir) / f"trl_vlm_fixes_hang_rank{context.rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(report + "\n")
        written.append(path)

    _within(WRITE_BUDGET_SECONDS, [lambda: _write_fd(saved_stderr(), report + "\n"), write_file])
    _within(LOG_BUDGET_SECONDS, [lambda: _log(seconds, context, written[0] if written else None)])
    os._exit(EXIT_CODE)


def _describe(describe: Callable[[], HangContext]) -> HangContext:
    try:
        return describe()
    except Exception as error:  # noqa: BLE001 - a trainer that is gone must not keep a hung process alive
        rank = os.environ.get("RANK", "0")
        rank_number = int(rank) if rank.isdigit() else 0
        return HangContext("a watched call", rank_number, "?", None, "?", f"(could not describe it: {error!r})")


def _within(budget: float, steps: list[Callable[[], None]]) -> None:
    """Each step in a daemon thread of its own, all of them waited for at most ``budget`` seconds."""
    threads = [
        threading.Thread(target=_quietly, args=(step,), name="trl_vlm_fixes-report", daemon=True) for step in steps
    ]
    for thread in threads:
        with contextlib.suppress(RuntimeError):  # no thread to be had: the kernel backstop still ends the process
            thread.start()
    end = time.monotonic() + budget
    for thread in threads:
        if thread.ident is not None:
            thread.join(max(end - time.monotonic(), 0.0))


def _quietly(step: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):  # a broken stream or handler must not keep a hung process alive
        step()


def _write_fd(fd: int, text: str) -> None:
    data = text.encode(errors="replace")
    while data:
        data = data[os.write(fd, data) :]


def _log(seconds: float, context: HangContext, path: Path | None) -> None:
    LOGGER.error(
        "trl_vlm_fixes: %s hung for %g s on rank %s at step %s; stacks in %s. Ending the process with exit code %d so "
        "restart logic takes over: restart with resume_from_checkpoint. Likely cause: %s",
        context.what,
        seconds,
        context.rank,
        context.step,
        path or "stderr (no report file)",
        EXIT_CODE,
        context.likely_cause,
    )
    for handler in logging.getLogger().handlers + LOGGER.handlers:
        handler.flush()


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


def hang_report(seconds: float, context: HangContext, notes: list[str] | None = None) -> str:
    return "\n".join(
        [
            f"trl_vlm_fixes rollout watchdog: {context.what} ran longer than {seconds:g} s "
            f"(TRL_VLM_FIXES_WATCHDOG) on rank {context.rank} at step {context.step}.",
            f"watch: {context.watch}",
            f"engine: {context.engine_settings}",
            f"likely cause: {context.likely_cause}",
            *(notes or []),
            f"resume: restart the job with resume_from_checkpoint (the process exits with {EXIT_CODE}, EX_TEMPFAIL).",
            "",
            "Python stacks (qualified names):",
            _stacks_with_qualified_names(),
        ]
    )
