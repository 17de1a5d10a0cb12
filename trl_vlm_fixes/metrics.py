"""Per-interval counters of the fixes' work, summed over ranks and flushed into the trainer's metrics when it logs.

Counters may be 0-dim tensors on the GPU: they are only read (``float``) when the trainer logs, which synchronizes
anyway, so counting adds no synchronization to the training step. Each rank counts its own work; only the main
process reports, so the log call adds every rank's counts up (one small all-reduce, see ``summed_over_ranks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .declaration import Counter, Target, on_trainers
from .owner_state import OwnerState
from .registry import active

PREFIX = "trl_vlm_fixes/"
_COUNT = "/count"  # a mean's item count, kept beside its sum until the log


def declared() -> tuple[Counter, ...]:
    """Every fix's counters, in the fixes' order: the same vector on every rank, whatever each rank counted."""
    return tuple(counter for fix in active().fixes.values() for counter in fix.counters)


# One value per owner and counter until the next log: memory stays bounded whatever logging_steps is, and for owners
# nobody drains (VLLMGeneration used by trainers whose ``log`` is not wrapped: GOLD, distillation, SDPO, ...).
_counters: OwnerState[dict[str, Any]] = OwnerState(dict)


def count(owner: Any, counter: Counter, amount: Any) -> None:
    """Add ``amount`` (an int or a 0-dim tensor, kept on its device) to ``owner``'s ``counter`` (a fix's declared
    one: a counter no fix declares would stay on its rank)."""
    totals = _counters.setdefault(owner)
    totals[counter.name] = totals[counter.name] + amount if counter.name in totals else amount


def count_mean(owner: Any, counter: Counter, total: Any, items: Any) -> None:
    """Add ``items`` items whose values sum to ``total`` to ``owner``'s mean ``counter``."""
    count(owner, counter, total)
    count(owner, Counter(counter.name + _COUNT), items)


def drain(owner: Any) -> dict[str, float]:
    """Read and reset ``owner``'s counts (the one place a device counter is read)."""
    pending = _counters.pop(owner) if owner is not None else None
    if not pending:
        return {}
    return {name: float(total) for name, total in pending.items()}


def summed_over_ranks(values: dict[str, float], accelerator: Any) -> dict[str, float]:
    """Every rank's counts of this interval added up (a mean: its sums and item counts added up, then divided); a
    metric appears if any rank counted it.

    One ``accelerator.reduce`` (an all-reduce) of a vector of fixed size, made on every rank at every ``log``:
    transformers' Trainer calls ``log`` on every rank at the same points (``_maybe_log_save_evaluate`` right after
    the all-rank ``nested_gather`` of the loss, ``_finalize_training`` after ``store_flos``'s broadcast, ``evaluate``
    after the evaluation loop's gathers), never from a rank-local branch, so the count of these collectives is the
    same on every rank whatever each rank counted. A single process reduces nothing.
    """
    counters = declared()
    sums = [c.name for c in counters if c.kind == "sum"]
    means = [c.name for c in counters if c.kind == "mean"]
    slots = [*sums, *means, *(name + _COUNT for name in means)]
    if getattr(accelerator, "num_processes", 1) > 1:
        import torch

        local = [values.get(name, 0.0) for name in slots] + [float(name in values) for name in slots]
        summed = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device), "sum").tolist()
        reduced = {name: summed[i] for i, name in enumerate(slots) if summed[len(slots) + i] > 0}
    else:
        reduced = {name: values[name] for name in slots if name in values}
    total = {name: value for name, value in reduced.items() if name in sums}
    for name in means:
        items = reduced.get(name + _COUNT, 0.0)
        if items > 0:
            total[name] = reduced.get(name, 0.0) / items
    return total


def _local_counts(instance: Any) -> dict[str, float]:
    values = drain(instance)
    for name, value in drain(getattr(instance, "vllm_generation", None)).items():
        values[name] = values.get(name, 0.0) + value
    return values


def flush_into_trainer_log(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Wrapper of the trainers' ``log``: adds this interval's counts, summed over ranks, to TRL's metrics, then logs."""
    try:
        values = _local_counts(instance)
    except Exception:  # noqa: BLE001 - metrics must never break logging; this rank still joins the reduce below
        values = {}
    values = summed_over_ranks(values, getattr(instance, "accelerator", None))
    try:
        if values:
            mode = "train" if instance.model.training else "eval"
            for name, value in values.items():
                instance._metrics[mode][name].append(value)
    except Exception:  # noqa: BLE001 - metrics must never break logging
        pass
    return wrapped(*args, **kwargs)


def support_targets() -> tuple[Target, ...]:
    return on_trainers({"log": flush_into_trainer_log})
