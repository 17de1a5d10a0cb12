"""reload_skip: rollouts run on the trainer's current weights, with no checkpoint reload from disk.

TRL 1.9.1's colocate + sleep-mode ``generate`` calls ``collective_rpc("reload_weights")`` after waking the engine (a
workaround for vLLM issue 29341). That reload reads the *original* checkpoint from disk, overwriting the weights that
``sync_weights`` has just pushed: every rollout after step 0 comes from the base model (TRL issue 5312). Skipping it
alone is not enough, since level-2 sleep discards the weights after every generate. So this fix tracks, per engine,
whether its weights were discarded (or the trainer's weights changed) since the last push, re-pushes them through
TRL's own ``sync_weights`` exactly then, and drops the disk reload.
"""

from __future__ import annotations

import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import wrapt

from .. import metrics
from ..registry import Fix, Target

LOGGER = logging.getLogger("trl_vlm_fixes")

_MODULE = "trl.generation.vllm_generation"
_RELOAD_CALL = 'collective_rpc("reload_weights")'


@dataclass
class EngineWeights:
    """What one colocated engine holds: ``discarded`` after level-2 sleep, else the push it last received."""

    discarded: bool = True  # TRL puts a fresh engine to sleep at level 2 before anything is pushed
    pushed_fingerprint: int | None = None
    repushes: int = 0
    reloads_skipped: int = 0


_engines: weakref.WeakKeyDictionary[Any, EngineWeights] = weakref.WeakKeyDictionary()


def engine_weights(generation: Any) -> EngineWeights:
    """The tracked state of one ``VLLMGeneration`` (kept off the instance, so revert leaves nothing behind)."""
    state = _engines.get(generation)
    if state is None:
        state = EngineWeights()
        _engines[generation] = state
    return state


def _colocated_with_sleep(generation: Any) -> bool:
    return getattr(generation, "mode", None) == "colocate" and bool(getattr(generation, "enable_sleep_mode", False))


def parameters_fingerprint(model: Any) -> int:
    """Sum of the parameters' in-place version counters: changes whenever an optimizer step updates them."""
    total = 0
    for parameter in model.parameters():
        total += parameter._version
        shard = getattr(parameter, "ds_tensor", None)  # DeepSpeed ZeRO-3 keeps the real values in a shard
        if shard is not None:
            total += shard._version
    return total


def _agree_across_ranks(generation: Any, needed: bool) -> bool:
    """Every rank must take the same decision: under ZeRO-3 / FSDP a push gathers parameters collectively."""
    accelerator = getattr(generation, "accelerator", None)
    if accelerator is None or getattr(accelerator, "num_processes", 1) <= 1:
        return needed
    import torch

    flag = torch.tensor([1 if needed else 0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="max").item())


class _EngineWithoutDiskReload(wrapt.ObjectProxy):  # type: ignore[misc]
    """The engine as TRL's ``generate`` sees it under this fix: no disk reload, level-2 sleeps recorded."""

    def __init__(self, engine: Any, state: EngineWeights, generation: Any) -> None:
        super().__init__(engine)
        self._self_state = state
        self._self_generation = generation

    def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        if method == "reload_weights":
            self._self_state.reloads_skipped += 1
            metrics.count(self._self_generation, metrics.DISK_RELOADS_SKIPPED, 1)
            return []
        return self.__wrapped__.collective_rpc(method, *args, **kwargs)

    def sleep(self, *args: Any, **kwargs: Any) -> Any:
        level = args[0] if args else kwargs.get("level", 1)
        result = self.__wrapped__.sleep(*args, **kwargs)
        if level >= 2:
            self._self_state.discarded = True
        return result


@contextmanager
def _engine_without_disk_reload(generation: Any, state: EngineWeights) -> Iterator[None]:
    engine = generation.llm
    proxy = _EngineWithoutDiskReload(engine, state, generation)
    generation.llm = proxy
    try:
        yield
    finally:
        if generation.__dict__.get("llm") is proxy:
            generation.llm = engine


def generate_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not _colocated_with_sleep(instance):
        return wrapped(*args, **kwargs)
    state = engine_weights(instance)
    stale = not state.discarded and state.pushed_fingerprint != parameters_fingerprint(instance.model)
    if _agree_across_ranks(instance, state.discarded or stale):
        LOGGER.debug(
            "trl_vlm_fixes.reload_skip: re-pushing trained weights before generate (%s)",
            "discarded by level-2 sleep" if state.discarded else "the trainer's weights changed since the last push",
        )
        instance.sync_weights()
        state.repushes += 1
        metrics.count(instance, metrics.WEIGHT_REPUSHES, 1)
    try:
        with _engine_without_disk_reload(instance, state):
            return wrapped(*args, **kwargs)
    finally:
        # TRL's generate ends with sleep(level=2); if it failed half-way the weights are unknown: re-push next time.
        state.discarded = True


def sync_weights_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    result = wrapped(*args, **kwargs)
    if _colocated_with_sleep(instance):
        state = engine_weights(instance)
        state.discarded = False
        state.pushed_fingerprint = parameters_fingerprint(instance.model)
    return result


def _generate_source(function: Callable[..., Any]) -> str | None:
    module = sys.modules.get(getattr(function, "__module__", ""), None)
    generation_class = getattr(module, "VLLMGeneration", None)
    try:
        return inspect.getsource(generation_class.generate if generation_class else function)
    except (OSError, TypeError):
        return None


def _upstream_repushes(function: Callable[..., Any]) -> str | None:
    source = _generate_source(function)
    if source is None or _RELOAD_CALL in source:
        return None
    if "sync_weights()" in source:
        return "this TRL re-pushes discarded weights itself and no longer reloads from disk (TRL >= 1.16)"
    return None


def _reload_shape(function: Callable[..., Any]) -> str | None:
    source = _generate_source(function)
    if source is None:
        return "source unavailable, cannot confirm the reload workaround"
    if _RELOAD_CALL in source or "sync_weights()" in source:
        return None
    return "VLLMGeneration.generate neither reloads from disk nor re-pushes: unknown sleep-mode handling"


FIX = Fix(
    name="reload_skip",
    summary="no disk reload in colocate + sleep mode; re-push trained weights whenever sleep discarded them",
    packages=("trl", "vllm"),
    targets=(
        Target(
            module=_MODULE,
            qualname="VLLMGeneration.generate",
            wrapper=generate_wrapper,
            shape_problem=_reload_shape,
            upstream_fixed=_upstream_repushes,
        ),
        Target(
            module=_MODULE,
            qualname="VLLMGeneration.sync_weights",
            wrapper=sync_weights_wrapper,
            shape_problem=_reload_shape,
            upstream_fixed=_upstream_repushes,
        ),
    ),
)
