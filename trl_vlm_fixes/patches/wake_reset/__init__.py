"""wake_reset: after every wake of the colocated engine's weights, no tensor a forward reads holds undefined memory.

In colocate + sleep mode TRL sleeps the engine at level 2 after every generate: vLLM 0.25.1 releases its whole
"weights" memory pool with no backup (``CuMemAllocator.sleep``), and on waking maps new pages whose contents are
whatever the driver hands out. vLLM restores the model's named buffers (``Worker.wake_up``) and TRL rewrites every
parameter (its push, or ``reload_weights`` from disk). Qwen3-VL's and Qwen3-VL-MoE's ``deepstack_input_embeds`` are
neither: plain tensors made with ``torch.zeros`` at build, in that pool, added to the hidden states after the first
text layers on every step, and rewritten by vLLM only in the rows an image step fills. After an unlucky wake every
text step (and every step longer than the last image step) adds garbage, NaN included, to the first layers' hidden
states; the run is right only where the driver happens to zero the new pages. Upstream TRL has the same exposure,
whether it reloads from disk (1.9.1) or re-pushes (1.16).

The fix wraps TRL's ``VLLMGeneration.generate`` and ``sync_weights`` (the two calls that wake the engine: TRL's own
path, and reload_skip's re-push, which goes through ``sync_weights``): while they run, the engine's ``wake_up`` is
followed, in this process (the one TRL pushes from: ``driver_worker.model_runner``), by putting every such tensor back
to what a fresh engine holds (``plain_tensors``), before any forward. Where the served model has none (Qwen3.5
and Qwen2.5-VL on vLLM 0.25.1), it steps aside with one line per engine. No collective operation is added.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import wrapt

from ...declaration import Applicability, Fix, Plan, Target
from ...logs import fix_logger
from ...model_facts import deepstack_levels
from ...owner_state import OwnerState

LOGGER = fix_logger(__name__)
_MODULE = "trl.generation.vllm_generation"


@dataclass
class _Generation:
    """One ``VLLMGeneration``: whether a wrapped call is running (the inner one adds nothing), what was said."""

    depth: int = 0
    aside: str | None = None  # why it stepped aside for this engine, once said


_generations: OwnerState[_Generation] = OwnerState(_Generation)


def _colocated_with_sleep(generation: Any) -> bool:
    return getattr(generation, "mode", None) == "colocate" and bool(getattr(generation, "enable_sleep_mode", False))


def reset_after_wake(engine: Any, generation: Any) -> None:
    """Put every plain tensor a forward reads back to a fresh engine's values (the engine's weights just woke)."""
    from .plain_tensors import read_by_forward, reset, served_model

    state = _generations.setdefault(generation)
    model = served_model(engine)
    if model is None:
        _aside(state, "no torch model at the engine's llm_engine.model_executor.driver_worker.model_runner here")
        return
    tensors = read_by_forward(model)
    if not tensors:
        _aside(state, f"{type(model).__name__} has no tensor outside its parameters and buffers that a forward reads")
        return
    reset(tensors)
    LOGGER.debug(
        "woken weights: %d tensors of %s put back to a fresh engine's values", len(tensors), type(model).__name__
    )


def _aside(state: _Generation, reason: str) -> None:
    if state.aside != reason:
        state.aside = reason
        LOGGER.info("steps aside for this engine: %s", reason)


class _EngineResetOnWake(wrapt.ObjectProxy):  # type: ignore[misc]
    """The engine as TRL's call sees it: a wake of its weights is followed by the reset."""

    def __init__(self, engine: Any, generation: Any) -> None:
        super().__init__(engine)
        self._self_generation = generation

    def wake_up(self, *args: Any, **kwargs: Any) -> Any:
        result = self.__wrapped__.wake_up(*args, **kwargs)
        tags = args[0] if args else kwargs.get("tags")
        if tags is None or "weights" in tags:
            reset_after_wake(self.__wrapped__, self._self_generation)
        return result


@contextmanager
def _engine_reset_on_wake(generation: Any) -> Iterator[None]:
    state = _generations.setdefault(generation)
    state.depth += 1
    engine = generation.llm
    proxy = _EngineResetOnWake(engine, generation) if state.depth == 1 else None
    if proxy is not None:
        generation.llm = proxy
    try:
        yield
    finally:
        state.depth -= 1
        if proxy is not None and generation.__dict__.get("llm") is proxy:
            generation.llm = engine


def wake_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``generate`` / ``sync_weights``: the engine's weights may wake in there (colocate + sleep mode only)."""
    if not _colocated_with_sleep(instance):
        return wrapped(*args, **kwargs)
    with _engine_reset_on_wake(instance):
        return wrapped(*args, **kwargs)


def scope(trainer: Any) -> str | None:
    """The bug needs a colocated engine with sleep mode, serving a model with such tensors."""
    generation = getattr(trainer, "vllm_generation", None)
    if not getattr(trainer, "use_vllm", False) or generation is None:
        return "use_vllm is off: no vLLM engine to wake"
    if not _colocated_with_sleep(generation):
        mode = getattr(generation, "mode", "?")
        return f"{mode} mode without colocated sleep mode: the engine's memory is never released"
    from .plain_tensors import read_by_forward, served_model

    model = served_model(getattr(generation, "llm", None))
    if model is not None and not read_by_forward(model):
        return f"{type(model).__name__} has no tensor outside its parameters and buffers that a forward reads"
    return None


def served_deepstack(plan: Plan) -> str | None:
    """A served model with deepstack tensors (an fp8 KV cache with computed scales has others, set by engine
    arguments, not the checkpoint)."""
    if not deepstack_levels(plan.config):
        kind = plan.config.get("model_type")
        return f"model type {kind!r} has no tensor outside its parameters and buffers that a forward reads"
    return None


_TARGETS = (
    Target(_MODULE, "VLLMGeneration.generate", wake_wrapper),
    Target(_MODULE, "VLLMGeneration.sync_weights", wake_wrapper),
)

FIX = Fix(
    name="wake_reset",
    summary="after every wake of the colocated engine, tensors outside parameters and buffers (Qwen3-VL's deepstack "
    "buffer) are put back to a fresh engine's values",
    packages=("trl", "vllm"),
    targets=_TARGETS,
    selftest="trl_vlm_fixes.selftest.checks.wake_reset:check",
    scope=scope,
    # ``scope`` before the trainer exists: colocate with sleep mode, a served model with deepstack tensors
    applicability=Applicability(
        modes=("colocate",),
        sleep_mode=True,
        aside={"none": "no vLLM engine to wake", "sleep_mode": "the engine's memory is never released"},
        families=("qwen3_vl", "qwen3_vl_moe"),
        checkpoint=served_deepstack,
    ),
)
