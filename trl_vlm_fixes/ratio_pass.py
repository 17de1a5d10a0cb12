"""Which pass gives the trainer's log-probs of a rollout: TRL's own no-gradient scoring pass (upstream), or, where
``scoring_skip`` acts, the loss pass of each of the rollout's micro-batches (its own log-probs, detached).

The core owns this seam so that the fix that moves the pass (``scoring_skip``) and the fix that processes what the
pass scores (``sampling_parity``: the log-probs TRL's ratio reads) never import each other: the first marks a
rollout whose pass is deferred and each loss pass that stands in for it, here; the second asks here which pass it is
in and leaves its result here. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

# the generation batch's row index, added to TRL's rollout output: TRL's shuffle and split carry it to the micro-batch
# each row's loss pass runs in (a 1-D tensor; TRL's loss reads only the keys it knows)
ROW_KEY = "trl_vlm_fixes_row"


@dataclass
class LossPass:
    """One micro-batch's loss pass standing in for the rollout's scoring pass."""

    inputs: dict[str, Any]  # the micro-batch TRL's loss reads: what the ratio gives is put here before TRL reads it
    scored: bool = False  # the policy's pass of this micro-batch has run (TRL's loss makes one)
    # the trainer's log-probs for TRL's ratio, where a fix processes them (sampling_parity), else None: TRL's own
    ratio_logps: Any = None


_deferred: ContextVar[bool] = ContextVar("trl_vlm_fixes_deferred_rollout", default=False)
_loss_pass: ContextVar[LossPass | None] = ContextVar("trl_vlm_fixes_loss_pass", default=None)


@contextmanager
def deferred_rollout() -> Iterator[None]:
    """While TRL's rollout runs without its scoring pass: no fix scores its other passes (the reference model's, a
    PEFT model with its adapters off) as if they were that one."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def rollout_deferred() -> bool:
    return _deferred.get()


def deferred(output: Mapping[str, Any]) -> bool:
    """Whether a rollout's output leaves the trainer's log-probs to its loss passes."""
    return ROW_KEY in output


@contextmanager
def loss_pass(inputs: dict[str, Any]) -> Iterator[LossPass]:
    current = LossPass(inputs)
    token = _loss_pass.set(current)
    try:
        yield current
    finally:
        _loss_pass.reset(token)


def current_loss_pass() -> LossPass | None:
    """The loss pass in progress that stands in for a scoring pass, or None."""
    return _loss_pass.get()
