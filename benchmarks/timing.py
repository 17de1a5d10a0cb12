"""The timing the CPU benchmarks share: the best of a few runs (the least disturbed by other work on the machine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def best_of(function: Callable[[], Any], repeat: int = 3) -> float:
    """The shortest of ``repeat`` wall-clock timings of ``function()``, in seconds."""
    timings = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        timings.append(time.perf_counter() - started)
    return min(timings)
