"""How much protection the engine being built needs, kept in one small state per ``output_dir``
(``trl_vlm_fixes_protection.json``: the level and the hangs that raised it), apart from the hang reports.

The watchdog's process records every hang there before it exits (``record_hang``); each engine hang raises the level
one step (vLLM's own graphs -> ``ENGINE_HANG`` -> ``REPEATED_HANG``), whatever the step; nothing lowers it (a crash, a
preemption, a clean restart, a hang elsewhere than the engine): delete the file to start unprotected. Every rank reads
it when its engine is built for a trainer the watchdog watches (``building_in``, set around a GRPO/RLOO trainer's
``__init__``); the engine fixes read what they declared for that level (``Fix.protected``). An unreadable state
protects (``ENGINE_HANG``) with a WARNING. The ranks of one vLLM tensor-parallel group compare what they build through
torch's key-value store (``agree_in_group``): a difference is an error at build, not a wait in graph capture.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from pathlib import Path
from typing import Any

from .log_once import warn_once
from .logs import fix_logger

LOGGER = fix_logger(__name__)
STATE_FILE = "trl_vlm_fixes_protection.json"
KEPT_HANGS = 100  # the history's last entries (a hang is rare: this bounds a file nobody prunes)
GROUP_WAIT_SECONDS = 120.0  # the ranks of a tensor-parallel group reach LLM(...) together (TRL's subgroup creation)


class Level(IntEnum):
    """The protection an engine gets; a fix's protected settings apply from the level they are declared at up."""

    NO_HANG = 0  # no engine hang recorded in output_dir: the selected settings
    ENGINE_HANG = 1  # one engine hang recorded (or an unreadable state)
    REPEATED_HANG = 2  # two or more, at any steps


@dataclass(frozen=True)
class Verdict:
    """The level, why (shown by the engine line, status and trainer start), and whether a hang can raise it."""

    level: Level = Level.NO_HANG
    reason: str = "no GRPO/RLOO trainer under the watchdog builds this engine: no protection state is read or written"
    armed: bool = False


NOT_ARMED = Verdict()
SERVER = Verdict(
    reason="trl vllm-serve reads no trainer's output_dir: after a hang the trainer's report names the flag to "
    "restart it with"
)
_building_output_dir: ContextVar[str | None] = ContextVar("trl_vlm_fixes_building_output_dir", default=None)
_last_built: Level | None = None  # the level of this process's last armed engine (a hang raises from there)
_builds = 0  # engines built in this process (each tensor-parallel comparison gets keys of its own)


class StateError(ValueError):
    """The state file exists but says nothing usable."""


class RanksDisagreeError(RuntimeError):
    """Ranks of one vLLM tensor-parallel group would build different engines (and wait on each other in capture)."""


@contextmanager
def building_in(output_dir: Any) -> Iterator[None]:
    """Engines built inside this block belong to a watched trainer writing into ``output_dir``."""
    token = _building_output_dir.set(str(output_dir) if output_dir else None)
    try:
        yield
    finally:
        _building_output_dir.reset(token)


def state_path(output_dir: str | os.PathLike[str]) -> Path:
    return Path(output_dir) / STATE_FILE


def read_state(output_dir: str | os.PathLike[str]) -> tuple[Level, list[dict[str, Any]]]:
    """The level and the hangs recorded in ``output_dir`` (none: no file); ``StateError`` where it cannot be read."""
    path = state_path(output_dir)
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return Level.NO_HANG, []
    except IsADirectoryError as error:
        raise StateError("a directory has its name") from error
    except OSError as error:
        raise StateError(f"unreadable: {error.strerror or error}") from error
    except ValueError as error:  # JSON or UTF-8: empty, truncated, binary
        raise StateError(f"not the watchdog's JSON: empty, truncated or binary ({type(error).__name__})") from error
    level = data.get("level") if isinstance(data, dict) else None
    hangs = data.get("hangs") if isinstance(data, dict) else None
    if not isinstance(level, str) or level not in Level.__members__ or not isinstance(hangs, list):
        raise StateError(f"no known level in it ({str(level)[:40]!r})")
    return Level[level], [hang for hang in hangs if isinstance(hang, dict)]


def write_state(output_dir: str | os.PathLike[str], level: Level, hangs: list[dict[str, Any]]) -> Path:
    """Replace the state whole (temporary file, fsync, ``os.replace``): a reader sees the old state or the new."""
    path = state_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name of this host, process and thread: ranks of several nodes sharing the directory never share a partial file
    partial = path.with_name(f".{STATE_FILE}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(partial, "w") as handle:
        json.dump({"level": level.name, "hangs": hangs[-KEPT_HANGS:]}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    with contextlib.suppress(OSError):  # the rename itself survives a preemption once the directory is on disk
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    return path


def record_hang(output_dir: str | os.PathLike[str], step: Any, kind: str, rank: int, engine: bool) -> Level:
    """The watchdog's process records its hang before it exits; returns the level the next engine here gets. An
    engine hang raises the level one step above the one this process's engine was built with (ranks of one attempt
    that hang together raise it once); nothing lowers it. An unreadable state counts as ``ENGINE_HANG``."""
    try:
        level, hangs = read_state(output_dir)
    except StateError:
        level, hangs = Level.ENGINE_HANG, []
    if engine:
        built = level if _last_built is None else _last_built
        level = Level(min(max(level, built + 1), max(Level)))
    hang = {"step": step if isinstance(step, int) else str(step), "kind": kind, "rank": rank, "engine": engine}
    hang["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_state(output_dir, level, [*hangs, hang])
    return level


def due(server: bool = False) -> Verdict:
    """The protection the engine being built needs (never raises: an unreadable state protects, with a WARNING)."""
    global _last_built
    output_dir = _building_output_dir.get()
    if server or output_dir is None:
        return SERVER if server else NOT_ARMED
    path = state_path(output_dir)
    try:
        level, hangs = read_state(output_dir)
    except StateError as problem:
        level, hangs = Level.ENGINE_HANG, []
        warn_once(
            ("unreadable", str(path), str(problem)),
            "the protection state %s cannot be read (%s): the engine is built with the protected level %s (%s); "
            "delete the file to build with the selected settings.",
            path,
            problem,
            level.name,
            protected_settings(level),
            logger=LOGGER,
        )
        reason = f"{path} cannot be read ({problem}): {level.name}"
    else:
        steps = [str(hang.get("step", "?")) for hang in hangs if hang.get("engine")]
        if level:
            reason = f"engine hangs recorded in {path} (at steps {', '.join(steps) or '?'}): {level.name}"
        else:
            reason = f"protection armed, no engine hang recorded in {path}"
    _last_built = level
    return Verdict(level, reason, armed=True)


def setting(fix_name: str, key: str, selected: Any, level: int) -> Any:
    """A fix's setting for an engine at ``level``, read from its declaration (``Fix.protected``)."""
    from .registry import active

    return protected_setting(active().fixes[fix_name].protected, key, selected, level)


def protected_setting(declared: tuple[tuple[int, str, Any], ...], key: str, selected: Any, level: int) -> Any:
    """The value of setting ``key`` at ``level``: the one declared for the highest level up to ``level``, unless the
    selected value is at least as protective (declared at that level or above); else the selected value. A pinned
    value is kept where it protects enough, and never lowered."""
    values = sorted((at, value) for at, name, value in declared if name == key)
    reached = [(at, value) for at, value in values if at <= level]
    if not reached:
        return selected
    at, value = reached[-1]
    selected_rank = max((rank for rank, candidate in values if candidate == selected), default=0)
    return selected if selected_rank >= at else value


def protected_settings(level: Level) -> str:
    """The settings the applied engine fixes give an engine at ``level``, e.g. ``cudagraph mode=PIECEWISE``."""
    from .registry import WRAPPED_STATES, active

    registry = active()
    settings = []
    for name, fix in registry.fixes.items():
        if not fix.protected or registry.fix_state(name)[0] not in WRAPPED_STATES:
            continue
        for key in dict.fromkeys(key for _, key, _ in fix.protected):
            selected = registry.value(name, key)
            settings.append(f"{name} {key}={protected_setting(fix.protected, key, selected, level)}")
    return ", ".join(settings) or "no engine fix with protected settings is applied"


def agree_in_group(builder: Any, built: str) -> None:
    """The ranks of one vLLM tensor-parallel group must build one engine: a rank that captured no CUDA graph while
    the others do would leave them waiting in capture, outside anything the watchdog watches. Each rank puts what it
    builds (``built``) in torch's key-value store (the rendezvous store, one key per rank and engine) and reads its
    group's: a key-value exchange, not a collective, so a rank that skips it (another setting, no plugin) costs at
    most ``GROUP_WAIT_SECONDS`` and a WARNING, never a collective out of step. A difference raises."""
    global _builds
    size = int(getattr(builder, "tensor_parallel_size", 1) or 1)
    try:
        import torch.distributed as dist

        if size <= 1 or not dist.is_available() or not dist.is_initialized():
            return
        store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    except Exception as error:  # noqa: BLE001 - no store: nothing to compare through
        LOGGER.warning("cannot compare the engine settings of the tensor-parallel group (%r).", error)
        return
    _builds += 1
    first = rank - rank % size
    keys = {peer: f"trl_vlm_fixes/engine{_builds}/rank{peer}" for peer in range(first, first + size)}
    try:
        store.set(keys[rank], built)
        store.wait(list(keys.values()), timedelta(seconds=GROUP_WAIT_SECONDS))
        seen = {peer: store.get(key).decode() for peer, key in keys.items()}
    except Exception as error:  # noqa: BLE001 - a rank that never said: the build goes on as it would upstream
        LOGGER.warning(
            "rank %d: the ranks %s of this vLLM tensor-parallel group did not all say which engine they build within "
            "%g s (%r): not compared.",
            rank,
            list(keys),
            GROUP_WAIT_SECONDS,
            error,
        )
        return
    if len(set(seen.values())) > 1:
        each = "; ".join(f"rank {peer}: {text}" for peer, text in seen.items())
        raise RanksDisagreeError(
            f"the ranks of one vLLM tensor-parallel group would build different engines ({each}), and wait on each "
            f"other in CUDA-graph capture. Give them one protection state: one output_dir for the group (or the same "
            f"{STATE_FILE} on every node), and the same TRL_VLM_FIXES_* settings."
        )
