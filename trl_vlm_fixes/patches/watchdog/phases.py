"""The phases of a training step besides the colocated rollout, each watched with a limit learned from the run itself.

These calls show no progress from outside (a weight push, a sleep, a forward, a backward, an optimizer step, a
generate on a server), so each is watched for its total time. A fixed limit would end a run whose phase is slow but
healthy (a server generate of long reasoning rollouts, a weight push of a large model) on every restart alike. So each
phase may take ``max(floor, FACTOR x its slowest completed call in this process)``: the floor
(``TRL_VLM_FIXES_WATCHDOG``; ``SERVER_FLOOR_FACTOR`` times it for a server generate) until it has completed once,
then ten times what it has been seen to need, if that is more. A call that raised teaches nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ...registry import TRAINERS
from . import owners
from .timer import WATCHDOG

FACTOR = 10.0
# a generate on `trl vllm-serve`: the whole global batch, progress unseen; 3 x the default 600 s = 1800 s, the limit
# every generate had before the watchdog watched progress
SERVER_FLOOR_FACTOR = 3.0

COLLECTIVE = (
    "a collective that never completes: another rank stopped, died or is stuck elsewhere (NCCL/gloo), FSDP or "
    "ZeRO-3 parameter gathering; or a device fault"
)
SLEEP_MODE = "vLLM's sleep mode (CuMemAllocator) freeing or mapping device memory; a device fault"
SERVER = "an unreachable or wedged `trl vllm-serve` (its own log says which), or its NCCL weight broadcast"

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass
class Phase:
    what: str  # as the hang report names it
    likely_cause: str
    floor_factor: float = 1.0
    slowest: float = 0.0  # seconds, the slowest completed call so far

    def limit(self, floor: float) -> float:
        return max(self.floor_factor * floor, FACTOR * self.slowest)


# After a checkpoint save every rank goes on at once, but under DDP only rank 0 writes (transformers' _save_checkpoint
# has no barrier): the others wait for it inside their next watched call (a gradient all-reduce, a tensor-parallel
# prompt gather). That first call after a save may take this many times the floor, so a slow save (an 8B model with its
# optimizer state on a network filesystem) never ends the waiting ranks.
SAVE_GRACE_FACTOR = 10.0
_saved = [False]


def checkpoint_saved() -> None:
    _saved[0] = True


def with_save_grace(limit: float, floor: float) -> float:
    """``limit``, or the save grace for the first watched call after a checkpoint save (then back to ``limit``)."""
    if not _saved[0]:
        return limit
    _saved[0] = False
    return max(limit, SAVE_GRACE_FACTOR * floor)


def save_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Trainer._save_checkpoint``, called by every rank alike: the next watched call gets the save grace."""
    try:
        return wrapped(*args, **kwargs)
    finally:
        checkpoint_saved()


def _arm(phase: Phase, floor: float, watched: Any) -> int:
    limit = with_save_grace(phase.limit(floor), floor)
    what = (
        f"{phase.what} (limit {limit:g} s: the larger of {phase.floor_factor * floor:g} s and {FACTOR:g} x its "
        f"slowest completed call, {phase.slowest:.3g} s)"
    )
    return WATCHDOG.arm(limit, owners.describe(what, watched, phase.likely_cause))


def run_watched(phase: Phase, floor: float, watched: Any, call: Callable[[], Any]) -> Any:
    token = _arm(phase, floor, watched)
    started = time.monotonic()
    try:
        result = call()
    finally:
        WATCHDOG.disarm(token)
    phase.slowest = max(phase.slowest, time.monotonic() - started)
    return result


def phase_wrapper(phase: Phase, floor: Callable[[], float], acts_on: Callable[[Any], bool] | None = None) -> Wrapper:
    """A wrapt wrapper that watches ``phase``; it steps aside when the watchdog is off or ``acts_on`` says no."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        seconds = floor()
        if not seconds or (acts_on is not None and not acts_on(instance)):
            return wrapped(*args, **kwargs)
        return run_watched(phase, seconds, instance, lambda: wrapped(*args, **kwargs))

    return wrapper


def a_trainers_part(instance: Any) -> bool:
    """Backward and clipping are accelerate's: watched only for a GRPO/RLOO trainer's accelerator (see below)."""
    return owners.trainer_of(instance) is not None


def a_grpo_or_rloo_trainer(instance: Any) -> bool:
    names = {name for _, name in TRAINERS}
    return any(cls.__name__ in names for cls in type(instance).__mro__)


@contextmanager
def optimizer_steps_watched(floor: float, trainer: Any) -> Iterator[None]:
    """While a GRPO/RLOO training loop runs, every torch optimizer step is watched, through torch's global step hooks.

    Not a wrapper on the optimizer's ``step``: torch's LR scheduler replaces ``optimizer.step`` on the instance with a
    function that calls the class's original (``step_fn.__func__``), past any wrapper on the class. The hooks exist
    only during the loop; a step that raised is disarmed when the loop ends (a notebook that catches the error lives).
    """
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    # per thread, innermost last (accelerate's wrapper may be a torch optimizer too): two optimizers stepping in two
    # threads never pop each other's watch
    armed: dict[int, list[tuple[int, float]]] = {}

    def before(optimizer: Any, args: Any, kwargs: Any) -> None:
        armed.setdefault(threading.get_ident(), []).append((_arm(OPTIMIZER_STEP, floor, trainer), time.monotonic()))

    def after(optimizer: Any, args: Any, kwargs: Any) -> None:
        mine = armed.get(threading.get_ident())
        if mine:
            token, started = mine.pop()
            WATCHDOG.disarm(token)
            OPTIMIZER_STEP.slowest = max(OPTIMIZER_STEP.slowest, time.monotonic() - started)

    handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for watches in armed.values():
            for token, _ in watches:
                WATCHDOG.disarm(token)


def training_loop_wrapper(floor: Callable[[], float]) -> Wrapper:
    """``Trainer._inner_training_loop`` of a GRPO/RLOO trainer: its optimizer steps are watched (see above)."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        seconds = floor()
        if not seconds or not a_grpo_or_rloo_trainer(instance):
            return wrapped(*args, **kwargs)
        with optimizer_steps_watched(seconds, instance):
            return wrapped(*args, **kwargs)

    return wrapper


def scoring_trainer(trainer: Any) -> bool:
    """The scoring pass runs before any backward: the trainer's accelerator and optimizer are recorded as its own."""
    owners.remember(trainer, trainer, getattr(trainer, "accelerator", None), getattr(trainer, "optimizer", None))
    return True


SYNC_WEIGHTS = Phase("VLLMGeneration.sync_weights (the weight push to vLLM)", COLLECTIVE)
SLEEP = Phase("vLLM LLM.sleep", SLEEP_MODE)
WAKE_UP = Phase("vLLM LLM.wake_up", SLEEP_MODE)
SCORING = Phase("_get_per_token_logps_and_entropies (a scoring or loss forward)", COLLECTIVE)
BACKWARD = Phase("Accelerator.backward (backward)", COLLECTIVE)
CLIPPING = Phase("Accelerator.clip_grad_norm_ (the gradient norm, an all-reduce under FSDP)", COLLECTIVE)
OPTIMIZER_STEP = Phase("the optimizer step (torch.optim.Optimizer.step)", COLLECTIVE)
SERVER_GENERATE = Phase("VLLMGeneration.generate (server mode: progress unseen)", SERVER, SERVER_FLOOR_FACTOR)
UNSTEPPED_GENERATE = Phase(
    "VLLMGeneration.generate (colocate, an engine without a step to watch)", COLLECTIVE, SERVER_FLOOR_FACTOR
)
