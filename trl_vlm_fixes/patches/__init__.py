"""One entry per fix, each ending in ``FIX = Fix(...)``: a module, or a package when the fix has a tensor core
(``mm_realign/realign.py``) or a mechanism of its own (``watchdog/timer.py``). ALL_FIXES is the report order."""

from __future__ import annotations

from ..registry import Fix
from . import (
    cudagraph,
    expert_layout,
    gdn_prefill,
    mm_realign,
    prompt_parity,
    reload_skip,
    sampling_parity,
    scoring_skip,
    vision_token_guard,
    wake_reset,
    watchdog,
    weight_buckets,
)
from .expert_layout import ExpertLayoutError

# ExpertLayoutError: the one fix's error the package re-exports (``trl_vlm_fixes.ExpertLayoutError``)
__all__ = ["ALL_FIXES", "ExpertLayoutError"]

ALL_FIXES: tuple[Fix, ...] = (
    mm_realign.FIX,
    prompt_parity.FIX,
    sampling_parity.FIX,
    reload_skip.FIX,
    wake_reset.FIX,
    cudagraph.FIX,
    gdn_prefill.FIX,
    expert_layout.FIX,
    vision_token_guard.FIX,
    weight_buckets.FIX,
    scoring_skip.FIX,
    watchdog.FIX,
)
