"""One top-p rule whatever the call's size: vLLM 0.31's kernel sends a small call (at most ``_SPLIT_MAX_BATCH``
rows) of top-p without top-k through a split-row pipeline and a larger one through its monolithic kernel, so an engine
step and a trainer chunk would cut by different rules. Both send such calls to the monolithic kernel (launched as
vLLM launches it for a large call: ``kernel_copy.monolithic_top_k_top_p``); every other call, and every call of a
kernel without that split (vLLM 0.25.1), goes to the kernel itself. Its own module so that the engine wrapper
(``engine_sampler``) and the trainer's rule (``vllm_rule``) share it without importing each other."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from . import kernel_copy


@functools.cache
def _monolithic_of(kernel: Callable[..., Any]) -> tuple[Callable[..., Any] | None, str | None]:
    """(the monolithic function, None) for an ``apply_top_k_top_p_triton`` (vLLM's, from its module's globals, or
    the interpreted copy) whose module splits small calls of top-p alone; (None, why) where that function cannot be
    launched; (None, None) where the module has no split (vLLM 0.25.1). Read once per kernel: every engine step asks."""
    copy = kernel_copy.copy_scope(kernel)
    scope: dict[str, Any] = copy[0] if copy is not None else getattr(kernel, "__globals__", {})
    if kernel_copy.split_max_batch(scope) is None:
        return None, None
    if problem := kernel_copy.monolithic_problem(scope):
        return None, problem
    if copy is not None:
        return copy[1], None if copy[1] is not None else "the interpreted copy has no monolithic function"
    return functools.partial(kernel_copy.monolithic_top_k_top_p, scope), None


def apply_kernel(
    kernel: Callable[..., Any], logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """``kernel`` (an ``apply_top_k_top_p_triton``: vLLM's or the interpreted copy) under a rule that does not depend
    on the call's size: top-p without top-k goes to its monolithic kernel where it would split a small call (vLLM
    0.31); every other call, and every call of a kernel without that split (0.25.1), to ``kernel`` itself (with
    top-k, 0.31 runs the monolithic kernel on every row whatever the size). What every routed engine step and the
    trainer apply."""
    if k is None and p is not None:
        monolithic = _monolithic_of(kernel)[0]
        if monolithic is not None:
            result: torch.Tensor = monolithic(logits, k, p)
            return result
    result = kernel(logits, k, p)
    return result
