"""vLLM's top-k/top-p rule, applied to the trainer's logits: the one place that decides which of vLLM's functions runs.

vLLM 0.25.1 has two: ``apply_top_k_top_p_triton`` (a pivot-search kernel: exactly k tokens at a top-k tie, an
approximate top-p cut) and ``apply_top_k_top_p_pytorch`` (a sort: every token tied with the k-th, the top-p cut by
sorted position). On CUDA it sends a step of 8 or more requests to the first, fewer to the second; the plugin's engine
wrapper (``engine_sampler``) sends every step to the kernel where vLLM has Triton, so the rule a step took is known
without knowing how many requests it held. Here the same function is applied to the trainer's logits:

- CUDA tensors where vLLM has Triton: vLLM's own ``apply_top_k_top_p_triton`` (the kernel the engine runs);
- CPU tensors where the kernel copy runs (``kernel_copy``): the same kernel in Triton's interpreter, with the CUDA
  tiles, as the engine stand-in runs it;
- elsewhere (an engine without Triton, or a vLLM whose kernel the copy was not proven on): vLLM's
  ``apply_top_k_top_p_pytorch`` without host syncs, the path such an engine takes at every step.

A row's result depends only on that row (the kernel gives each row to one program), so any chunk of rows may be
passed. The processed log-probs are then ``log_softmax`` of the result in float32, as vLLM's ``forward_native``.

vLLM 0.31's ``apply_top_k_top_p_triton`` picks its rule by the call's size itself: on CUDA a call of at most
``_SPLIT_MAX_BATCH`` (64) rows with top-p and no top-k takes a split-row pipeline (its split set by the call's size and
the SM count), a larger one its monolithic kernel. ``apply_kernel`` sends such a call straight to the monolithic kernel
(``kernel_copy.monolithic_top_k_top_p``: vLLM's own ``_topk_topp`` launched as vLLM launches it for a large call), so
the rule does not depend on the size; the engine wrapper sends every routed step through ``apply_kernel`` too, and
``size_dependent_top_p`` names the case where it cannot.
"""

from __future__ import annotations

import functools
import importlib

import torch

from . import kernel_copy, wide_launch
from .monolithic import apply_kernel

TRITON = "triton"
PYTORCH = "pytorch"


@functools.cache
def _vllm_has_triton() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def _uses_cuda_kernel(device: torch.device) -> bool:
    return device.type == "cuda" and _vllm_has_triton()


def _uses_interpreted_kernel(device: torch.device) -> bool:
    return device.type == "cpu" and kernel_copy.why_no_copy() is None


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's top-k/top-p masking of float32 ``[rows, vocab]`` logits (-inf where a token is cut), as every step of
    the plugin's engine applies it. ``k``/``p``: one value per row (k = vocabulary size, p = 1.0: not truncated), or
    None. May modify ``logits`` in place; use the result."""
    if k is None and p is None:
        return logits
    if _uses_cuda_kernel(logits.device):
        scope = vars(importlib.import_module(kernel_copy.KERNEL_MODULE))
        proven = kernel_copy.why_no_copy() is None  # a kernel file whose launch was read for a wide one
        if proven and wide_launch.launchable(scope, logits.size(0), k, p):
            return wide_launch.wide_top_k_top_p(scope, kernel_copy.CUDA_TILES, logits, k, p)
        return apply_kernel(scope["apply_top_k_top_p_triton"], logits, k, p)
    if _uses_interpreted_kernel(logits.device):
        scope = kernel_copy.copy_namespace(kernel_copy.CUDA_TILES)
        if wide_launch.launchable(scope, logits.size(0), k, p):
            with kernel_copy.interpreting():
                return wide_launch.wide_top_k_top_p(scope, kernel_copy.CUDA_TILES, logits, k, p)
        return apply_kernel(kernel_copy.interpreted_top_k_top_p(kernel_copy.CUDA_TILES), logits, k, p)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=False)


def engine_path() -> str:
    """``"triton"`` or ``"pytorch"``: which of vLLM's functions every engine step applies (the GPU engine with the
    plugin's wrapper, or the engine stand-in on this machine)."""
    return TRITON if _vllm_has_triton() or kernel_copy.why_no_copy() is None else PYTORCH


def _splits_small_calls() -> bool:
    """Does the installed kernel split small calls of top-p alone (vLLM 0.31)?"""
    try:
        return kernel_copy.split_max_batch(vars(importlib.import_module(kernel_copy.KERNEL_MODULE))) is not None
    except ImportError:
        return False


def describe() -> str:
    """One line for the logs: the path, and why."""
    if _vllm_has_triton():
        if _splits_small_calls():
            return (
                "every engine step goes through vLLM's Triton top-k/top-p kernel, top-p without top-k through its "
                "monolithic kernel whatever the step's size (vLLM would split steps of at most 64 requests); the "
                "trainer applies the same functions"
            )
        return (
            "every engine step goes through vLLM's Triton top-k/top-p kernel (apply_top_k_top_p_triton; the plugin "
            "sends steps of fewer than 8 requests there too); the trainer applies the same kernel"
        )
    if (reason := kernel_copy.why_no_copy()) is None:
        split = (
            "; top-p without top-k through its monolithic kernel whatever the step's size (132 SMs, an H100's)"
            if _splits_small_calls()
            else ""
        )
        return (
            "no Triton driver here: vLLM's Triton top-k/top-p kernel runs in Triton's interpreter with the CUDA tiles "
            f"(8192/4096), in the engine stand-in and for the trainer alike{split}"
        )
    return f"vLLM's sort-based top-k/top-p (apply_top_k_top_p_pytorch) at every step: vLLM has no Triton, and {reason}"


def size_dependent_top_p(top_k: int, top_p: float, device: torch.device, vocabulary: int) -> str | None:
    """Why the engine's top-p cut and the trainer's cannot take one rule, or None. vLLM >= 0.31 sends a CUDA call of
    top-p without top-k and at most ``_SPLIT_MAX_BATCH`` rows (an engine step of up to 64 requests) through a
    split-row pipeline whose rows are split by the call's size and the GPU's SM count, larger calls (the trainer's
    chunks) through the monolithic kernel: a row's cut depends on its step, unless the engine wrapper sends every
    step to the monolithic kernel (``apply_kernel``; ``engine_sampler.routes_top_p_alone``), as the trainer does.
    CPU tensors where the interpreted copy is the rule (it dispatches as on CUDA) are judged alike. A row with an
    active top-k takes the monolithic kernel whatever the call's size (0 < k < the vocabulary: ``InputBatch`` gives
    no k otherwise)."""
    if top_p >= 1.0 or 0 < top_k < vocabulary:
        return None
    if device.type == "cuda":
        scope = vars(importlib.import_module(kernel_copy.KERNEL_MODULE))
    elif _uses_interpreted_kernel(device):
        scope = kernel_copy.copy_namespace(kernel_copy.CUDA_TILES)
    else:
        return None
    limit = kernel_copy.split_max_batch(scope)
    if limit is None:
        return None
    from .engine_sampler import routes_top_p_alone

    if (why_not := routes_top_p_alone()) is None:
        return None
    return (
        f"vLLM's top-p without top-k takes a split-row pipeline in engine steps of at most {limit} requests (its split "
        "set by the step's size and the GPU's SM count) and its monolithic kernel in larger calls, so the engine's "
        f"cut and the trainer's differ by step, and {why_not} (set top_k to keep the ratio exact)"
    )
