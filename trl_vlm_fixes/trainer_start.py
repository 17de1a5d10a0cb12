"""When a GRPO or RLOO trainer is built: rank 0 shows the final state of every fix once, where users look: at INFO in
a healthy run, at WARNING where an enabled fix was skipped (it should act and cannot).

The import-time summary can only say ``pending`` (TRL is not imported yet); by the time a trainer exists every target
is imported and every state is final; an engine fix that acted on the trainer's engine adds what vLLM built and why
(``cudagraph=applied (cudagraph_mode=PIECEWISE (protected: ...))``). The trainer is also recorded as the owner of its
vLLM engine, so a watchdog report can name the step and write into ``output_dir`` (each fix's declared
``at_trainer_start``: the watchdog's). Reached through the registry: this module imports no fix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .declaration import Target, on_trainers
from .logs import fix_logger
from .registry import active

LOGGER = fix_logger(__name__)
_announced = False


def _after_init(trainer: Any, version: str) -> None:
    from .engine_args import engine_readings

    registry = active()
    for fix in registry.fixes.values():
        if fix.at_trainer_start is not None:
            fix.at_trainer_start(trainer)
    generation = getattr(trainer, "vllm_generation", None)
    registry.record_scope(trainer)  # each fix: does it act for this trainer's model and mode?
    global _announced
    accelerator = getattr(trainer, "accelerator", None)
    if _announced or not getattr(accelerator, "is_main_process", True):
        return
    _announced = True
    readings = engine_readings(getattr(generation, "llm", None))
    states, skipped = [], False
    for name, fix in registry.fixes.items():
        state, detail = registry.fix_state(name)
        skipped = skipped or state == "skipped"
        switch = fix.switch_setting
        if state == "applied" and switch is not None and switch.unit:
            state += f" ({registry.value(name, switch.key):g} {switch.unit})"
        elif state == "stepped-aside":
            state += f" ({detail.partition(': ')[2]})"
        elif state == "applied" and name in readings:
            state += f" ({readings[name]})"
        states.append(f"{name}={state}")
    # a healthy run says this at INFO; WARNING where an enabled fix cannot act (skipped), or where the engine is
    # protected because an earlier run here hung (the line names the hang report)
    protected = any("protected:" in reading for reading in readings.values())
    level = logging.WARNING if skipped or protected else logging.INFO
    LOGGER.log(level, "%s at trainer start: %s (python -m trl_vlm_fixes for details)", version, ", ".join(states))


def support_targets(version: str) -> tuple[Target, ...]:
    """The wrapper on every GRPO/RLOO trainer's ``__init__``; ``version``: the plugin's, which heads the line."""

    def after_trainer_init(
        wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            _after_init(instance, version)
        except Exception as error:  # noqa: BLE001 - reporting must never break building a trainer
            LOGGER.debug("could not report at trainer start: %r", error)
        return result

    return on_trainers({"__init__": after_trainer_init})
