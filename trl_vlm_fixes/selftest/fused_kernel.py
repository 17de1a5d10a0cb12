"""``sampling_parity``'s one-pass log-prob kernel (``fused_logprob.body``) run by Triton's interpreter, for the tests
and the GPU script's dry run: built and launched inside ``kernel_copy.interpreting()``, as vLLM's interpreted kernels
are; it counts the positions its launches covered (the path was taken)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..patches.sampling_parity import fused_logprob, kernel_copy


class InterpretedKernel:
    """What ``fused_logprob.kernel`` gives on a GPU (``kernel[grid](...)``), here in Triton's interpreter."""

    def __init__(self) -> None:
        import triton

        with kernel_copy.interpreting():
            self.kernel = triton.jit(fused_logprob.body)
        self.positions = 0

    def __getitem__(self, grid: tuple[int]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.positions += grid[0]
            with kernel_copy.interpreting():
                self.kernel[grid](*args, **kwargs)

        return launch
