"""reload_skip: rollouts run on the trainer's current weights, with no checkpoint reload from disk.

TRL 1.9.1's colocate + sleep-mode ``generate`` calls ``collective_rpc("reload_weights")`` after waking the engine (a
workaround for vLLM issue 29341). That reload reads the *original* checkpoint from disk, overwriting the weights that
``sync_weights`` has just pushed: every rollout after step 0 comes from the base model (TRL issue 5312). Skipping it
alone is not enough, since level-2 sleep discards the weights after every generate. So this fix:

- drops the disk reload;
- keeps the engine awake between the turns of one rollout (the trainer's ``_generate``: a multi-turn tool loop or a
  ``rollout_func`` calls ``generate`` once per turn, a number each rank decides alone): TRL's level-2 sleep is deferred
  to the end of the rollout, so later turns need neither a push nor a reload;
- re-pushes the trained weights through TRL's own ``sync_weights`` before a generate whose engine lost them;
- after a push into an engine that generated since its caches were last cleared (only inside a rollout, where the
  sleep is deferred), resets vLLM's encoder cache: it keeps vision embeddings by image hash across requests, and
  only a sleep of level >= 1 or ``reload_weights`` clears it (vLLM 0.25.1 ``EngineCore._reset_caches``,
  ``GPUModelRunner.reload_weights``), so a repeated image would reuse embeddings of the old vision tower. TRL's
  ``sync_weights`` resets the prefix cache itself; the multimodal processor cache holds preprocessed inputs, which
  do not depend on the weights.

``TRL_VLM_FIXES_RELOAD_SKIP_TOOL_SLEEP=1`` makes the engine sleep at level 1 between the turns instead (weights to
CPU memory, KV cache freed: a tool that needs the GPU gets it back; the weights come back on waking, without a push).

No collective operation is added. Every push decision is taken from events every rank sees alike (the engine's
weights were discarded by a level-2 sleep), except the ``parameters_fingerprint`` check, which is used only where a
push is rank-local (no ZeRO-3, no FSDP), so it can never make one rank enter a collective gather alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import wrapt

from .. import metrics
from ..declaration import Applicability, Counter, Fix, Target, VersionBound, on_trainers
from ..log_once import warn_once
from ..logs import fix_logger
from ..owner_state import OwnerState
from ..registry import value
from ..source_shape import calls_method, function_tree
from ..switches import boolean

LOGGER = fix_logger(__name__)
WEIGHT_REPUSHES = Counter("trl_vlm_fixes/weight_repushes")
DISK_RELOADS_SKIPPED = Counter("trl_vlm_fixes/disk_reloads_skipped")
# level-1 sleep between the turns of a tool loop (default off: the engine stays awake between turns)
TOOL_SLEEP = boolean("tool_sleep", "TRL_VLM_FIXES_RELOAD_SKIP_TOOL_SLEEP", False)

_MODULE = "trl.generation.vllm_generation"


@dataclass
class EngineWeights:
    """What one colocated engine holds: ``discarded`` after level-2 sleep, else the push it last received."""

    discarded: bool = True  # TRL puts a fresh engine to sleep at level 2 before anything is pushed
    pushed_fingerprint: tuple[int, ...] | None = None
    repushes: int = 0
    reloads_skipped: int = 0
    rollout_depth: int = 0  # > 0 while the trainer's _generate runs: sleeps between turns are deferred
    deferred_sleep: int | None = None  # the sleep level TRL asked for inside the rollout, done when it ends
    tool_sleep: bool = False  # this rollout sleeps at level 1 between turns (TRL_VLM_FIXES_RELOAD_SKIP_TOOL_SLEEP)
    turn_slept: bool = False  # ... and the engine did so after a turn: it wakes for real, and ends the rollout asleep
    caches_warm: bool = False  # a generate ran since vLLM last cleared its caches (a sleep of level >= 1)


_engines: OwnerState[EngineWeights] = OwnerState(EngineWeights)


def engine_weights(generation: Any) -> EngineWeights:
    """The tracked state of one ``VLLMGeneration`` (kept off the instance, so revert leaves nothing behind)."""
    return _engines.setdefault(generation)


def _colocated_with_sleep(generation: Any) -> bool:
    return getattr(generation, "mode", None) == "colocate" and bool(getattr(generation, "enable_sleep_mode", False))


def parameters_fingerprint(model: Any) -> tuple[int, ...]:
    """(sum of in-place version counters, hash of parameter identities and storages) of the trainer's model.

    Seen: in-place updates through the parameter itself (``optimizer.step()``, ``p.add_``, ``p.copy_``, also on a
    view of it), a ZeRO-3 shard updated in place (``ds_tensor``), a parameter replaced by another object, and
    ``p.data = other`` (its storage changes). Not seen: writes through ``p.data`` or through another alias of the same
    storage, such as the flat buffers of DeepSpeed ZeRO-1/2 (their version counters are not the parameter's). In TRL's
    own flows this check never decides a push: with sleep mode every rollout ends in a level-2 sleep, after which the
    engine re-receives the weights anyway; it only catches a generate after an optimizer step with no rollout between.
    """
    versions = 0
    identities = []
    for parameter in model.parameters():
        versions += parameter._version
        identities.append((id(parameter), parameter.data_ptr()))
        shard = getattr(parameter, "ds_tensor", None)  # DeepSpeed ZeRO-3 keeps the real values in a shard
        if shard is not None:
            versions += shard._version
    return versions, hash(tuple(identities))


def push_is_collective(generation: Any) -> bool:
    """Under ZeRO-3 or FSDP ``sync_weights`` gathers parameters collectively: every rank must push together."""
    dist = getattr(generation, "_dist", None)
    if dist is not None:
        return bool(getattr(dist, "is_zero3", False) or getattr(dist, "is_fsdp", False))
    state = getattr(getattr(generation, "accelerator", None), "state", None)
    plugin = getattr(state, "deepspeed_plugin", None)
    return getattr(plugin, "zero_stage", 0) == 3 or str(getattr(state, "distributed_type", "")).endswith("FSDP")


class _EngineWithoutDiskReload(wrapt.ObjectProxy):  # type: ignore[misc]
    """The engine as TRL's ``generate`` sees it: no disk reload; sleeps deferred inside a rollout, recorded outside."""

    def __init__(self, engine: Any, state: EngineWeights, generation: Any) -> None:
        super().__init__(engine)
        self._self_state = state
        self._self_generation = generation

    def collective_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        if method == "reload_weights":
            self._self_state.reloads_skipped += 1
            metrics.count(self._self_generation, DISK_RELOADS_SKIPPED, 1)
            return []
        return self.__wrapped__.collective_rpc(method, *args, **kwargs)

    def sleep(self, *args: Any, **kwargs: Any) -> Any:
        level = args[0] if args else kwargs.get("level", 1)
        state = self._self_state
        if state.rollout_depth > 0:  # more turns of this rollout may follow: keep the weights
            state.deferred_sleep = max(level, state.deferred_sleep or 0)
            if state.tool_sleep:  # weights to CPU memory, KV cache freed; they come back on waking, no push
                self.__wrapped__.sleep(level=1)
                state.turn_slept, state.caches_warm = True, False
            return None
        result = self.__wrapped__.sleep(*args, **kwargs)
        state.caches_warm = state.caches_warm and level < 1
        if level >= 2:
            state.discarded = True
        return result

    def wake_up(self, *args: Any, **kwargs: Any) -> Any:
        state = self._self_state
        if state.deferred_sleep is not None and not state.turn_slept:  # its sleep was deferred: it is awake already
            return None
        return self.__wrapped__.wake_up(*args, **kwargs)


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


@contextmanager
def rollout_scope(generation: Any) -> Iterator[None]:
    """One rollout (all turns of a tool loop): TRL's closing sleep is deferred to its end, done once, for real.

    Only colocate + sleep mode has such a sleep; for anything else this is a no-op.
    """
    if not _colocated_with_sleep(generation):
        yield
        return
    state = engine_weights(generation)
    if state.rollout_depth == 0:
        state.tool_sleep = bool(value("reload_skip", TOOL_SLEEP.key))
    state.rollout_depth += 1
    try:
        yield
    finally:
        state.rollout_depth -= 1
        if state.rollout_depth == 0:
            _close_rollout(generation, state)


def _close_rollout(generation: Any, state: EngineWeights) -> None:
    """TRL's deferred sleep, done once; after a level-1 turn sleep the engine is asleep already and keeps its
    weights in CPU memory (vLLM's executor ignores a sleep while asleep: ``Executor.sleep``, "already sleeping")."""
    level, state.deferred_sleep = state.deferred_sleep, None
    slept, state.turn_slept = state.turn_slept, False
    if level is None or slept:
        return
    state.discarded = state.discarded or level >= 2
    state.caches_warm = state.caches_warm and level < 1
    generation.llm.sleep(level=level)


def generate_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not _colocated_with_sleep(instance):
        return wrapped(*args, **kwargs)
    state = engine_weights(instance)
    stale = (
        not state.discarded
        and not push_is_collective(instance)
        and state.pushed_fingerprint != parameters_fingerprint(instance.model)
    )
    if state.discarded or stale:
        LOGGER.debug(
            "re-pushing trained weights before generate (%s)",
            "discarded by level-2 sleep" if state.discarded else "the trainer's weights changed since the last push",
        )
        instance.sync_weights()
        state.repushes += 1
        metrics.count(instance, WEIGHT_REPUSHES, 1)
    state.caches_warm = True
    try:
        with _engine_without_disk_reload(instance, state):
            return wrapped(*args, **kwargs)
    except BaseException:
        state.discarded = True  # it failed half-way: what the engine holds is unknown, push again next time
        raise


def sync_weights_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    result = wrapped(*args, **kwargs)
    if _colocated_with_sleep(instance):
        state = engine_weights(instance)
        state.discarded = False
        state.pushed_fingerprint = parameters_fingerprint(instance.model)
        if state.caches_warm:
            _reset_encoder_cache(instance.llm)
            state.caches_warm = False
    return result


def _reset_encoder_cache(engine: Any) -> None:
    """Drop the vision embeddings computed with the weights before this push (``LLMEngine.reset_encoder_cache``:
    ``vllm.LLM`` 0.25.1 has no method of its own for it; ``LLM.reset_mm_cache`` leaves the encoder cache alone)."""
    reset = getattr(getattr(engine, "llm_engine", None), "reset_encoder_cache", None)
    if reset is None:
        warn_once(
            "reload_skip encoder cache",
            "this vLLM engine has no llm_engine.reset_encoder_cache(); after a push "
            "between the turns of a rollout a repeated image may reuse embeddings of the previous weights.",
        )
        return
    reset()


def rollout_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The trainer's ``_generate``: every ``generate`` it makes (one per tool-loop turn) belongs to one rollout."""
    generation = getattr(instance, "vllm_generation", None)
    if generation is None:
        return wrapped(*args, **kwargs)
    with rollout_scope(generation):
        return wrapped(*args, **kwargs)


def _generate_tree(function: Callable[..., Any]) -> Any:
    """The AST of ``VLLMGeneration.generate``: from the target's own module where it defines it, else TRL's."""
    import importlib
    import sys

    module = sys.modules.get(getattr(function, "__module__", "") or "")
    generation_class = getattr(module, "VLLMGeneration", None)
    if generation_class is None:
        generation_class = getattr(importlib.import_module(_MODULE), "VLLMGeneration", None)
    return function_tree(generation_class.generate) if generation_class is not None else None


def _upstream_repushes(function: Callable[..., Any]) -> str | None:
    tree = _generate_tree(function)
    if tree is None or calls_method(tree, "collective_rpc", "reload_weights"):
        return None
    if calls_method(tree, "sync_weights"):
        return "this TRL re-pushes discarded weights itself and no longer reloads from disk (TRL >= 1.16)"
    return None


def _reload_shape(function: Callable[..., Any]) -> str | None:
    tree = _generate_tree(function)
    if tree is None:
        return "source unavailable, cannot confirm the reload workaround"
    if calls_method(tree, "collective_rpc", "reload_weights") or calls_method(tree, "sync_weights"):
        return None
    return "VLLMGeneration.generate neither reloads from disk nor re-pushes: unknown sleep-mode handling"


def scope(trainer: Any) -> str | None:
    """The bug needs TRL's colocated engine with sleep mode (``VLLMGeneration.generate``'s reload)."""
    generation = getattr(trainer, "vllm_generation", None)
    if not getattr(trainer, "use_vllm", False) or generation is None:
        return "use_vllm is off: no vLLM engine to reload"
    if not _colocated_with_sleep(generation):
        return f"{getattr(generation, 'mode', '?')} mode without colocated sleep mode: TRL reloads nothing from disk"
    return None


# every target of this fix relies on TRL's generate reloading from disk, and steps aside where TRL re-pushes itself
_CHECKS: dict[str, Any] = {"shape_problem": _reload_shape, "upstream_fixed": _upstream_repushes}


FIX = Fix(
    name="reload_skip",
    summary="no disk reload in colocate + sleep mode; re-push trained weights whenever sleep discarded them",
    packages=("trl", "vllm"),
    targets=(
        Target(_MODULE, "VLLMGeneration.generate", generate_wrapper, **_CHECKS),
        Target(_MODULE, "VLLMGeneration.sync_weights", sync_weights_wrapper, **_CHECKS),
        *on_trainers({"_generate": rollout_wrapper}, **_CHECKS),
    ),
    settings=(TOOL_SLEEP,),
    counters=(WEIGHT_REPUSHES, DISK_RELOADS_SKIPPED),
    selftest="trl_vlm_fixes.selftest.checks.reload_skip:check",
    scope=scope,
    # ``scope`` before the trainer exists: only TRL's colocated engine with sleep mode reloads from disk; TRL 1.16
    # re-pushes itself (``_upstream_repushes``)
    applicability=Applicability(
        modes=("colocate",),
        sleep_mode=True,
        aside={"none": "no vLLM engine to reload", "sleep_mode": "TRL reloads nothing from disk"},
        versions=(VersionBound("trl", "1.16.0"),),
    ),
)
