"""Per-step counters of the fixes' work, flushed into the trainer's own metrics when it logs.

Counters may be 0-dim tensors on the GPU: they are only read (``float``) when the trainer logs, which synchronizes
anyway, so counting adds no synchronization to the training step.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from .registry import Target, on_trainers

PREFIX = "trl_vlm_fixes/"
REALIGNED_ROWS = PREFIX + "mm_realigned_rows"
WEIGHT_REPUSHES = PREFIX + "weight_repushes"
DISK_RELOADS_SKIPPED = PREFIX + "disk_reloads_skipped"
VISION_TOKEN_ROWS_MASKED = PREFIX + "vision_token_rows_masked"
PROMPT_MISMATCH_ROWS = PREFIX + "prompt_mismatch_rows"

# One running total per owner and counter: memory stays bounded whatever logging_steps is, and for owners nobody
# drains (VLLMGeneration used by trainers whose ``log`` is not wrapped: GOLD, distillation, SDPO, ...).
_counters: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def count(owner: Any, name: str, amount: Any) -> None:
    """Add ``amount`` (an int or a 0-dim tensor, kept on its device) to ``owner``'s running total ``name``."""
    # an owner that cannot be weakly referenced: counting is best effort, never an error
    with contextlib.suppress(TypeError):
        totals = _counters.setdefault(owner, {})
        totals[name] = totals[name] + amount if name in totals else amount


def drain(owner: Any) -> dict[str, float]:
    """Read and reset ``owner``'s totals (the one place a device counter is read)."""
    pending = _counters.pop(owner, None) if owner is not None else None
    if not pending:
        return {}
    return {name: float(total) for name, total in pending.items()}


def flush_into_trainer_log(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Wrapper of the trainers' ``log``: adds this interval's counters to TRL's own metrics, then logs."""
    try:
        values = drain(instance)
        for name, value in drain(getattr(instance, "vllm_generation", None)).items():
            values[name] = values.get(name, 0.0) + value
        if values:
            mode = "train" if instance.model.training else "eval"
            for name, value in values.items():
                instance._metrics[mode][name].append(value)
    except Exception:  # noqa: BLE001 - metrics must never break logging
        pass
    return wrapped(*args, **kwargs)


def support_targets() -> tuple[Target, ...]:
    return on_trainers({"log": flush_into_trainer_log})
