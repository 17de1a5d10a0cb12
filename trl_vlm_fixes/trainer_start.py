"""When a GRPO or RLOO trainer is built: rank 0 shows the final state of every fix once, where users look: at INFO in
a healthy run, at WARNING where an enabled fix was skipped (it should act and cannot).

The import-time summary can only say ``pending`` (TRL is not imported yet); by the time a trainer exists every target
is imported and every state is final; an engine fix that acted on the trainer's engine adds what vLLM built and why
(``cudagraph=applied (cudagraph_mode=PIECEWISE (protected: ...))``). The trainer is also recorded as the owner of its
vLLM engine, so a watchdog report can name the step and write into ``output_dir``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .declaration import Target, on_trainers
from .logs import fix_logger

LOGGER = fix_logger(__name__)
_announced = False


def after_trainer_init(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        _after_init(instance)
    except Exception as error:  # noqa: BLE001 - reporting must never break building a trainer
        LOGGER.debug("could not report at trainer start: %r", error)
    return result


def _after_init(trainer: Any) -> None:
    from . import REGISTRY, __version__
    from .engine_args import engine_readings
    from .patches.watchdog import register_owner

    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:
        register_owner(generation, trainer)
    REGISTRY.record_scope(trainer)  # each fix: does it act for this trainer's model and mode?
    global _announced
    accelerator = getattr(trainer, "accelerator", None)
    if _announced or not getattr(accelerator, "is_main_process", True):
        return
    _announced = True
    readings = engine_readings(getattr(generation, "llm", None))
    states, skipped = [], False
    for name, fix in REGISTRY.fixes.items():
        state, detail = REGISTRY.fix_state(name)
        skipped = skipped or state == "skipped"
        switch = fix.switch_setting
        if state == "applied" and switch is not None and switch.unit:
            state += f" ({REGISTRY.value(name, switch.key):g} {switch.unit})"
        elif state == "stepped-aside":
            state += f" ({detail.partition(': ')[2]})"
        elif state == "applied" and name in readings:
            state += f" ({readings[name]})"
        states.append(f"{name}={state}")
    # a healthy run says this at INFO; WARNING where an enabled fix cannot act (skipped), or where the engine is
    # protected because an earlier run here hung (the line names the hang report)
    protected = any("protected:" in reading for reading in readings.values())
    level = logging.WARNING if skipped or protected else logging.INFO
    LOGGER.log(level, "%s at trainer start: %s (python -m trl_vlm_fixes for details)", __version__, ", ".join(states))


def support_targets() -> tuple[Target, ...]:
    return on_trainers({"__init__": after_trainer_init})
