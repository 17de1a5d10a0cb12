"""When a GRPO or RLOO trainer is built: rank 0 shows the final state of every fix once, where users look.

The import-time summary can only say ``pending`` (TRL is not imported yet); by the time a trainer exists every target
is imported and every state is final. The trainer is also recorded as the owner of its vLLM engine, so a watchdog
report can name the step and write into ``output_dir``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .registry import Target, on_trainers

LOGGER = logging.getLogger("trl_vlm_fixes")
_announced = False


def after_trainer_init(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        _after_init(instance)
    except Exception as error:  # noqa: BLE001 - reporting must never break building a trainer
        LOGGER.debug("trl_vlm_fixes: could not report at trainer start: %r", error)
    return result


def _after_init(trainer: Any) -> None:
    from . import REGISTRY, __version__
    from .patches.watchdog import register_owner
    from .switches import watchdog_seconds

    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:
        register_owner(generation, trainer)
    global _announced
    accelerator = getattr(trainer, "accelerator", None)
    if _announced or not getattr(accelerator, "is_main_process", True):
        return
    _announced = True
    states = []
    for name in REGISTRY.fixes:
        state = REGISTRY.fix_state(name)[0]
        if name == "watchdog" and state == "applied":
            state += f" ({watchdog_seconds():g} s)"
        states.append(f"{name}={state}")
    LOGGER.warning("trl_vlm_fixes %s: %s (python -m trl_vlm_fixes for details)", __version__, ", ".join(states))


def support_targets() -> tuple[Target, ...]:
    return on_trainers({"__init__": after_trainer_init})
