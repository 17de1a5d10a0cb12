"""Total-time limits for the calls whose progress cannot be seen, set so that no healthy call reaches them.

A weight push, an engine sleep or wake-up, a server's generate show no progress from outside: each is watched whole.
A first call in a process (cold allocator, JIT, the first push of the whole model) may take ``FIRST_CALL_FACTOR`` x the
floor; later ones the larger of the floor and ``FACTOR`` x the slowest completed call. The slowest calls are kept in
``output_dir`` and read back when a trainer is built there: a restart never allows less than the run it replaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...log_once import warn_once
from ...logs import fix_logger
from . import owners
from .timer import WATCHDOG

FACTOR = 10.0
FIRST_CALL_FACTOR = 10.0  # 100 min at the default 600 s floor
FILE_PREFIX = "trl_vlm_fixes_watchdog_limits_rank"
LOGGER = fix_logger(__name__)


@dataclass
class Phase:
    key: str  # in the limits file and the report's ``watch:`` line
    what: str
    likely_cause: str
    floor_factor: float = 1.0
    slowest: float = 0.0  # the slowest completed call, in this process or read back from output_dir
    completed: bool = False  # one completed in this process

    def base(self, floor: float) -> float:
        return max(self.floor_factor, 1.0 if self.completed else FIRST_CALL_FACTOR) * floor

    def limit(self, floor: float) -> float:
        return round(max(self.base(floor), FACTOR * self.slowest), 1)


SLEEP_MODE = "vLLM's sleep mode (CuMemAllocator) freeing or mapping device memory; a device fault"
SYNC_WEIGHTS = Phase(
    "sync_weights",
    "VLLMGeneration.sync_weights (the weight push to vLLM)",
    f"{SLEEP_MODE}; a slow or wedged `trl vllm-serve` receiving the weights (server mode)",
)
SLEEP = Phase("sleep", "vLLM LLM.sleep", SLEEP_MODE)
WAKE_UP = Phase("wake_up", "vLLM LLM.wake_up", SLEEP_MODE)
# a generate on `trl vllm-serve`: the whole global batch, its progress unseen; 3 x 600 s, what it had before
SERVER_GENERATE = Phase(
    "server_generate",
    "VLLMClient.generate (server mode: progress unseen)",
    "an unreachable or wedged `trl vllm-serve` (its own log says which)",
    floor_factor=3.0,
)
ENGINE_GENERATE = Phase(
    "engine_generate",
    "LLM.generate (colocate, an engine without a step to watch)",
    "a hung kernel in the engine; a device fault",
    floor_factor=3.0,
)
PHASES = (SYNC_WEIGHTS, SLEEP, WAKE_UP, SERVER_GENERATE, ENGINE_GENERATE)


def run_watched(phase: Phase, floor: float, watched: Any, call: Callable[[], Any]) -> Any:
    limit, first = phase.limit(floor), "" if phase.completed else " for a first call"
    what = (
        f"{phase.what} (limit {limit:g} s: the larger of {phase.base(floor):g} s{first} "
        f"and {FACTOR:g} x its slowest completed call, {phase.slowest:.3g} s)"
    )
    token = WATCHDOG.arm(limit, owners.describe(what, watched, phase.likely_cause, phase.key))
    started = time.monotonic()
    try:
        result = call()
    finally:
        WATCHDOG.disarm(token)
    took = time.monotonic() - started
    phase.completed = True
    if took > phase.slowest:
        phase.slowest = took
        _keep(watched)
    return result


def _keep(watched: Any) -> None:
    """This rank's slowest calls, into the owning trainer's output_dir (replaced whole: a reader never sees half)."""
    try:
        rank, output_dir = owners.rank_and_output_dir(watched)
        if output_dir is None:
            return
        path = Path(output_dir) / f"{FILE_PREFIX}{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({phase.key: phase.slowest for phase in PHASES if phase.slowest}))
        os.replace(partial, path)
    except Exception as error:  # noqa: BLE001 - the limits stay learned in this process; a restart starts generous
        warn_once(
            ("limits", type(error)),
            "cannot keep the learned limits in output_dir (%r): a restart starts from the first-call limits.",
            error,
            logger=LOGGER,
        )


def restore(output_dir: str | os.PathLike[str] | None) -> None:
    """Read back every rank's learned limits from a run in ``output_dir`` (the largest of each)."""
    if not output_dir or not os.path.isdir(output_dir):
        return
    by_key = {phase.key: phase for phase in PHASES}
    for path in Path(output_dir).glob(f"{FILE_PREFIX}*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            for key, seconds in json.loads(path.read_text()).items():
                if key in by_key:
                    by_key[key].slowest = max(by_key[key].slowest, float(seconds))
