"""watchdog: every vLLM generate TRL makes (colocate and server mode) runs under the rollout watchdog.

``TRL_VLM_FIXES_WATCHDOG`` (``switches.watchdog_seconds``): on (the default limit), off (then nothing is wrapped and no
thread exists) or a number of seconds >= 10, read once per ``apply()`` (``selected_limit``) so that a run never changes
its limit halfway. A generate that runs past it ends the process with exit code 75 after writing every thread's
stack, the step and the engine settings (``timer.py``, ``report.py``, ``backstop.py``).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Any

from ... import engine_args
from ...registry import Fix, Target
from ...switches import watchdog_seconds
from .timer import WATCHDOG, HangContext

_MODULE = "trl.generation.vllm_generation"
LIKELY_CAUSE = (
    "on Hopper with vLLM 0.25.1 and a Gated-DeltaNet model (Qwen3.5), FlashInfer 0.6.13's GDN prefill kernel "
    "(flashinfer-ai/flashinfer#3986, #2623: TRL_VLM_FIXES_GDN_PREFILL_BACKEND=triton, the default); CUDA-graph decode "
    "(TRL_VLM_FIXES_CUDAGRAPH_MODE=NONE); in server mode, an unreachable or wedged `trl vllm-serve`"
)

_limit: float | None = None  # set by selected_limit() at apply()

# the trainer that owns each VLLMGeneration (registered when the trainer is built): step and output_dir for reports
_owners: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def register_owner(generation: Any, trainer: Any) -> None:
    with contextlib.suppress(TypeError):
        _owners[generation] = weakref.proxy(trainer)


def _context(generation: Any) -> Callable[[], HangContext]:
    def describe() -> HangContext:
        trainer = _owners.get(generation)
        state = getattr(trainer, "state", None)
        args = getattr(trainer, "args", None)
        accelerator = getattr(generation, "accelerator", None)
        rank = getattr(accelerator, "process_index", None)
        return HangContext(
            what=f"VLLMGeneration.generate ({getattr(generation, 'mode', '?')} mode)",
            rank=int(rank if rank is not None else os.environ.get("RANK", 0)),
            step=getattr(state, "global_step", "?"),
            output_dir=str(getattr(args, "output_dir", None) or "."),
            engine_settings=engine_args.last_engine_settings,
            likely_cause=LIKELY_CAUSE,
        )

    return describe


def selected_limit() -> float:
    """Read TRL_VLM_FIXES_WATCHDOG now (apply() calls it: a bad value fails the import); generates use this value."""
    global _limit
    _limit = watchdog_seconds()
    return _limit


def generate_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    limit = selected_limit() if _limit is None else _limit
    if not limit:  # switched off by a later apply() while the wrapper stayed: step aside
        return wrapped(*args, **kwargs)
    token = WATCHDOG.arm(limit, _context(instance))
    try:
        return wrapped(*args, **kwargs)
    finally:
        WATCHDOG.disarm(token)


FIX = Fix(
    name="watchdog",
    summary="a vLLM generate that hangs ends the process (exit 75) with its stacks, so restart logic takes over",
    packages=("trl",),
    targets=(Target(_MODULE, "VLLMGeneration.generate", generate_wrapper),),
)
