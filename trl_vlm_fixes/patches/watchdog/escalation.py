"""How much protection the next engine in an ``output_dir`` needs, read from the hang reports no run has used yet
(``protection.Level``): none; ``ENGINE_HANG`` after a colocated generate whose engine made no progress (the
engine-step rule, or the total-time rule of an engine without a step to watch); ``REPEATED_HANG`` after an engine hang
at the step of the engine hang the run had restarted after (the same batch replayed). The level never drops while
hangs go on: a report says which level its own engine had (``protection:``), and an engine hang after it keeps at
least that. A run that ends any other way leaves no unused report: the next start is a fresh one.

The reports also say what protects: the restart's settings (from the engine fixes' declarations), and on a server
generate that never returned, the flag of ``trl vllm-serve`` that gives its engine the same protection.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from ... import protection
from ...log_once import warn_once
from ...logs import fix_logger
from ...protection import Level, Verdict
from . import report
from .limits import ENGINE_GENERATE, SERVER_GENERATE
from .report import ENGINE_STEP

LOGGER = fix_logger(__name__)
REPEATED = "repeated hang:"
# the rules that fire on a colocated generate whose engine made no progress
ENGINE_WATCHES = (ENGINE_STEP, ENGINE_GENERATE.key)
_UNUSED = re.compile(r"trl_vlm_fixes_hang_rank(\d+)\.txt")
_STEP = re.compile(r" at step (\d+)\.")
_WATCH = re.compile(r"^watch: (\S+)$", re.MULTILINE)
_BUILT = re.compile(r"^protection: this engine was built with (\w+)", re.MULTILINE)

# (step, watch) of each hang the run in this process restarted after
_restarted_after: set[tuple[str, str]] = set()
# the protection the last engine of this process was built with (its hang report says it)
_engine_level = Level.NO_HANG


def unused_reports(output_dir: str | os.PathLike[str] | None) -> dict[Path, str]:
    """Every rank's hang report in ``output_dir`` that no run has used yet: path -> text."""
    found: dict[Path, str] = {}
    if not output_dir or not os.path.isdir(output_dir):
        return found
    for path in sorted(Path(output_dir).iterdir()):
        if _UNUSED.fullmatch(path.name):
            with contextlib.suppress(OSError):
                found[path] = path.read_text(errors="replace")
    return found


def hang_step(text: str) -> int | None:
    """The step a report names on its first line (``... on rank 1 at step 3.``)."""
    match = _STEP.search(text.split("\n", 1)[0])
    return int(match.group(1)) if match else None


def hang_watch(text: str) -> str:
    match = _WATCH.search(text)
    return match.group(1) if match else "other"


def restarted_after(reports: dict[Path, str]) -> None:
    """The run in this process restarts after these reports (``train()`` read them)."""
    _restarted_after.clear()
    _restarted_after.update((str(hang_step(text)), hang_watch(text)) for text in reports.values())


def report_level(text: str) -> Level:
    """The protection the restart after this report needs: none unless its engine made no progress."""
    if hang_watch(text) not in ENGINE_WATCHES:
        return Level.NO_HANG
    if REPEATED in text:
        return Level.REPEATED_HANG
    built = _BUILT.search(text)
    had = Level[built.group(1)] if built and built.group(1) in Level.__members__ else Level.NO_HANG
    return max(Level.ENGINE_HANG, had)


def verdict(output_dir: str | os.PathLike[str] | None) -> Verdict:
    """The protection an engine built for a trainer writing into ``output_dir`` needs, and the report that says so."""
    global _engine_level
    if not output_dir:
        found = Verdict(Level.NO_HANG, "no trainer's output_dir known here: no hang report to read")
    else:
        levels = [(report_level(text), path, text) for path, text in unused_reports(output_dir).items()]
        level, path, text = max(levels, key=lambda item: item[0], default=(Level.NO_HANG, None, ""))
        if path is None or not level:
            found = Verdict(Level.NO_HANG, f"no engine hang reported in {output_dir}")
        else:
            found = Verdict(level, _reason(level, path, text))
            warn_once(
                ("protected", str(output_dir), level),
                "%s: the engine is built with the protection for it.",
                found.reason,
                logger=LOGGER,
            )
    _engine_level = found.level
    return found


def _reason(level: Level, path: Path, text: str) -> str:
    step = hang_step(text)
    if REPEATED in text:
        happened = f"the engine hung again at step {step}, where the run before had hung too"
    else:
        happened = f"the engine made no progress at step {step}"
    return f"{happened} ({path}: {level.name})"


protection.register(verdict)


def protected_settings(level: Level) -> str:
    """The settings the engine fixes declare for ``level`` (those wrapped in this process), e.g.
    ``cudagraph mode=PIECEWISE``; their selected values where those protect as much."""
    from ...registry import WRAPPED_STATES, active

    registry = active()
    settings = []
    for name, fix in registry.fixes.items():
        if not fix.protected or registry.fix_state(name)[0] not in WRAPPED_STATES:
            continue
        for key in dict.fromkeys(key for _, key, _ in fix.protected):
            selected = registry.value(name, key)
            settings.append(f"{name} {key}={protection.protected_setting(fix.protected, key, selected, level)}")
    return ", ".join(settings) or "no engine fix with protected settings is applied"


def _level_after(context: report.HangContext) -> Level:
    if context.watch not in ENGINE_WATCHES:
        return Level.NO_HANG
    if (str(context.step), context.watch) in _restarted_after:
        return Level.REPEATED_HANG
    return max(Level.ENGINE_HANG, _engine_level)


def _repeat_note(context: report.HangContext) -> str | None:
    """The report's line for an engine hang at the step of the engine hang this run restarted after."""
    if context.watch not in ENGINE_WATCHES or (str(context.step), context.watch) not in _restarted_after:
        return None
    return (
        f"{REPEATED} the run restarted after an engine hang at step {context.step} and its engine hung again at step "
        f"{context.step} (the same batch replayed)."
    )


def _protection_note(context: report.HangContext) -> str | None:
    """Which protection this engine had, and what the restart's engine gets (for a model with Gated-DeltaNet
    layers; another model's engine is built as before)."""
    after = _level_after(context)
    if not after:
        return None
    return (
        f"protection: this engine was built with {_engine_level.name}; the restart in this output_dir builds the "
        f"engine with {after.name} ({protected_settings(after)}) where the engine fixes act (a model with "
        "Gated-DeltaNet layers)."
    )


def _server_note(context: report.HangContext) -> str | None:
    """On a server generate that never returned: the flag that gives the server's engine the protection."""
    if context.watch != SERVER_GENERATE.key:
        return None
    repeated = (str(context.step), context.watch) in _restarted_after
    mode = "NONE" if repeated else "PIECEWISE"
    from ...engine_args import server_builds_elsewhere

    if server_builds_elsewhere():  # TRL >= 1.11: vLLM's own server, its own flags
        flag = f'`trl vllm-serve ... --compilation-config \'{{"cudagraph_mode": "{mode}"}}\'`'
    else:
        flag = f"`TRL_VLM_FIXES_CUDAGRAPH_MODE={mode} trl-vlm-fixes run -- trl vllm-serve ...`"
    again = " again at this step" if repeated else ""
    return (
        f"server: if the server's engine is wedged{again} (its log stopped, its GPU busy) and it serves a model "
        f"with Gated-DeltaNet layers (Qwen3.5), restart it with {flag}: no process of the server reads this report."
    )


for _note in (_repeat_note, _protection_note, _server_note):
    if _note not in report.NOTES:
        report.NOTES.append(_note)
