"""One module per fix; ALL_FIXES is the order in which they are reported."""

from __future__ import annotations

from ..registry import Fix
from . import cudagraph, gdn_prefill, mm_realign, reload_skip, vision_token_guard, watchdog

ALL_FIXES: tuple[Fix, ...] = (
    mm_realign.FIX,
    reload_skip.FIX,
    cudagraph.FIX,
    gdn_prefill.FIX,
    vision_token_guard.FIX,
    watchdog.FIX,
)
