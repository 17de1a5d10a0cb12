"""watchdog: every phase of a GRPO/RLOO step runs under the watchdog; a colocated rollout is judged by its progress.

``TRL_VLM_FIXES_WATCHDOG`` (``switches.watchdog_seconds``): on (the default limit), off (then nothing is wrapped and no
thread exists) or a number of seconds >= 10, read once per ``apply()`` (``selected_limit``) so that a run never changes
its limit halfway. A colocated generate is hung when its engine returned no step for that long (``progress.py``),
however long the rollout; every other phase (weight push, sleep and wake, scoring, backward, optimizer step, a
server-mode generate) gets a limit learned from its own completed calls (``phases.py``). A watch that passes its limit
ends the process with exit code 75 after writing every thread's stack, the step and the engine settings
(``timer.py``, ``report.py``, ``backstop.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ...registry import Fix, Target, on_trainers
from ...switches import watchdog_seconds
from . import owners, phases, progress
from .resume import RESUME_TARGETS
from .timer import WATCHDOG, HangContext

_MODULE = "trl.generation.vllm_generation"
LIKELY_CAUSE = (
    "on Hopper with vLLM 0.25.1 and a Gated-DeltaNet model (Qwen3.5), FlashInfer 0.6.13's GDN prefill kernel "
    "(flashinfer-ai/flashinfer#3986, #2623: TRL_VLM_FIXES_GDN_PREFILL_BACKEND=triton, the default); CUDA-graph decode "
    "(TRL_VLM_FIXES_CUDAGRAPH_MODE=NONE); in server mode, an unreachable or wedged `trl vllm-serve`"
)

_limit: float | None = None  # set by selected_limit() at apply()


def register_owner(generation: Any, trainer: Any) -> None:
    """At trainer start: its VLLMGeneration, engine and accelerator report the trainer's step, rank and output_dir."""
    owners.remember(trainer, generation, getattr(generation, "llm", None), getattr(trainer, "accelerator", None))


def _context(generation: Any, what: str) -> Callable[[], HangContext]:
    return owners.describe(what, generation, LIKELY_CAUSE)


def selected_limit() -> float:
    """Read TRL_VLM_FIXES_WATCHDOG now (apply() calls it: a bad value fails the import); generates use this value."""
    global _limit
    _limit = watchdog_seconds()
    return _limit


def _current_limit() -> float:
    return selected_limit() if _limit is None else _limit


def generate_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Colocate: hung when no engine step returned for the limit. Server mode: a learned total limit (``phases``)."""
    limit = _current_limit()
    if not limit:  # switched off by a later apply() while the wrapper stayed: step aside
        return wrapped(*args, **kwargs)
    mode = getattr(instance, "mode", "?")
    engine = getattr(getattr(instance, "llm", None), "llm_engine", None) if mode == "colocate" else None
    if not progress.steppable(engine):
        phase = phases.SERVER_GENERATE if mode == "server" else phases.UNSTEPPED_GENERATE
        return phases.run_watched(phase, limit, instance, lambda: wrapped(*args, **kwargs))
    what = f"VLLMGeneration.generate ({mode} mode): the wait for the next vLLM engine step"
    token = WATCHDOG.arm(phases.with_save_grace(limit, limit), _context(instance, what))
    try:
        with progress.steps_report(engine, functools.partial(WATCHDOG.progress, token)):
            return wrapped(*args, **kwargs)
    finally:
        WATCHDOG.disarm(token)


def _phase(phase: phases.Phase, acts_on: Callable[[Any], bool] | None = None) -> phases.Wrapper:
    return phases.phase_wrapper(phase, _current_limit, acts_on)


_ENGINE = "vllm.entrypoints.llm"  # sleep and wake wherever they are called (TRL, reload_skip, a user)
PHASE_TARGETS = (
    Target(_MODULE, "VLLMGeneration.sync_weights", _phase(phases.SYNC_WEIGHTS)),
    Target(_ENGINE, "LLM.sleep", _phase(phases.SLEEP), optional=True),
    Target(_ENGINE, "LLM.wake_up", _phase(phases.WAKE_UP), optional=True),
    *on_trainers({"_get_per_token_logps_and_entropies": _phase(phases.SCORING, phases.scoring_trainer)}),
    Target("accelerate.accelerator", "Accelerator.backward", _phase(phases.BACKWARD, phases.a_trainers_part)),
    Target("accelerate.accelerator", "Accelerator.clip_grad_norm_", _phase(phases.CLIPPING, phases.a_trainers_part)),
    Target("transformers.trainer", "Trainer._inner_training_loop", phases.training_loop_wrapper(_current_limit)),
    Target("transformers.trainer", "Trainer._save_checkpoint", phases.save_wrapper),
)


FIX = Fix(
    name="watchdog",
    summary="a hung phase of a step (a rollout without progress, a weight push, a backward...) ends the process (exit "
    "75) with its stacks, so restart logic takes over",
    packages=("trl",),
    targets=(Target(_MODULE, "VLLMGeneration.generate", generate_wrapper), *PHASE_TARGETS, *RESUME_TARGETS),
)
