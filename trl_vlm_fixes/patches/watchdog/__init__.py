"""watchdog: a colocated engine that stops stepping, or an engine or server call that never returns, ends the process
(exit 75) with every thread's stack, so restart logic takes over; the restart resumes (``resume.py``).

Only what nothing else watches: the colocated engine by its progress (a single-GPU kernel hang has no collective to
time out, ``engine.py``); calls that show no progress and wait on no other rank (an unsharded weight push, the engine's
sleep and wake-up, a server's generate) by a total time no healthy call reaches (``limits.py``). Every wait on another
rank (TRL's gathers, backward, a ZeRO-3/FSDP push, rank 0's checkpoint save) is torch's process-group timeout's.
``TRL_VLM_FIXES_WATCHDOG`` (setting ``seconds``, read at ``apply()``) is the progress limit and every floor; off:
nothing wrapped, no thread. ``TRL_VLM_FIXES_WATCHDOG_RESUME`` (setting ``resume``): off, a restart starts as upstream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...declaration import VLLM_MODES, Applicability, Fix, Target
from ...registry import value
from ...switches import Setting, SwitchValueError
from . import engine, limits, owners
from .resume import RESUME, RESUME_TARGETS

SWITCH = "TRL_VLM_FIXES_WATCHDOG"
# 10 minutes without an engine step (one decode token, or one prefill chunk: seconds at most); every other floor
DEFAULT_SECONDS = 600.0
MIN_SECONDS = 10.0  # below this, a slow but healthy generate would end the run
ACCEPTED = (
    f"on/true/yes/1 (the default limit, {DEFAULT_SECONDS:g} s), off/false/no/0 (no watchdog), "
    f"or a number of seconds of at least {MIN_SECONDS:g} (any case)"
)
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_seconds(raw: str) -> float:
    """``TRL_VLM_FIXES_WATCHDOG``: on (the default limit), off (0) or a number of seconds of at least 10."""
    text = raw.strip().lower()
    if not text or text in _ON:
        return DEFAULT_SECONDS
    if text in _OFF:
        return 0.0
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if math.isfinite(seconds) and seconds >= MIN_SECONDS:
        return seconds
    raise SwitchValueError(f"{SWITCH}={raw!r} is not a rollout watchdog setting. Accepted values: {ACCEPTED}.")


SECONDS = Setting("seconds", SWITCH, parse_seconds, DEFAULT_SECONDS, ACCEPTED, "s")


def _floor() -> float:
    """The ``seconds`` setting as the last ``apply()`` read it: a run never changes its limit."""
    return float(value("watchdog", SECONDS.key))


def register_owner(generation: Any, trainer: Any) -> None:
    """At trainer start (after the engine build): its objects report the trainer's step, rank and ``output_dir``, and
    the limits learned by an earlier run there are read back."""
    owners.remember(trainer, generation, getattr(generation, "llm", None), getattr(generation, "vllm_client", None))
    limits.restore(getattr(getattr(trainer, "args", None), "output_dir", None))


def at_trainer_start(trainer: Any) -> None:
    """Declared (``Fix.at_trainer_start``): a trainer with a vLLM generation owns it (``register_owner``)."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:
        register_owner(generation, trainer)


def generate_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``VLLMGeneration.generate``: the engine (colocate) or server call inside it is watched, not the gathers."""
    floor = _floor()
    if not floor:  # apply(watchdog={"seconds": 0}) unwraps; a wrapper someone kept steps aside
        return wrapped(*args, **kwargs)
    if getattr(instance, "mode", None) == "colocate":
        watch = engine.watch_engine(getattr(instance, "llm", None), floor, instance)
    else:
        watch = engine.watch_server(getattr(instance, "vllm_client", None), floor, instance)
    with watch:
        return wrapped(*args, **kwargs)


def _sharded(generation: Any) -> bool:
    """Under ZeRO-3 or FSDP the push gathers parameters: a wait on the other ranks, torch's to time."""
    state = getattr(getattr(generation, "accelerator", None), "state", None)
    zero3 = getattr(getattr(state, "deepspeed_plugin", None), "zero_stage", 0) == 3
    return zero3 or getattr(state, "fsdp_plugin", None) is not None


def _total(phase: limits.Phase, acts_on: Callable[[Any], bool]) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        floor = _floor()
        if not floor or not acts_on(instance):
            return wrapped(*args, **kwargs)
        return limits.run_watched(phase, floor, instance, lambda: wrapped(*args, **kwargs))

    return wrapper


def _owned(engine_instance: Any) -> bool:
    """An engine whose trainer is built: the sleep inside the build (TRL's ``_init_vllm``) belongs to the build."""
    return owners.trainer_of(engine_instance) is not None


_MODULE = "trl.generation.vllm_generation"
_ENGINE = "vllm.entrypoints.llm"
FIX = Fix(
    name="watchdog",
    summary="a colocated engine without progress, or an engine or server call that never returns, ends the process "
    "(exit 75) with its stacks, so restart logic takes over; the restart resumes",
    packages=("trl",),
    targets=(
        Target(_MODULE, "VLLMGeneration.generate", generate_wrapper),
        Target(_MODULE, "VLLMGeneration.sync_weights", _total(limits.SYNC_WEIGHTS, lambda g: not _sharded(g))),
        Target(_ENGINE, "LLM.sleep", _total(limits.SLEEP, _owned), optional=True),
        Target(_ENGINE, "LLM.wake_up", _total(limits.WAKE_UP, _owned), optional=True),
        *RESUME_TARGETS,
    ),
    settings=(RESUME,),
    switch_setting=SECONDS,
    # it watches vLLM's engine and server calls; without vLLM there are none
    applicability=Applicability(modes=VLLM_MODES, aside={"none": "no vLLM engine or server call to watch"}),
    at_trainer_start=at_trainer_start,
)
