"""The engine's temperature step, applied to the trainer's float32 logits: its last bits decide vLLM's approximate
top-p cut, so the trainer runs the arithmetic the engine ran, not a division of its own.

vLLM's V1 sampler divides each row by its request's float32 temperature tensor (``Sampler.apply_temperature``: IEEE
division on every device). The V2 model runner divides in a Triton kernel (``vllm/v1/worker/gpu/sample/gumbel.py``,
``apply_temperature``): compiled for CUDA, Triton's float32 ``/`` is an approximate division (measured on an H100,
docs/gpu-results.md section 14: it equals a multiplication by the reciprocal, one ulp from IEEE division in many
elements), which moved the top-p kernel's cut by 5-8 tokens in some rows (up to 0.027 nats per token). So on CUDA,
where the engine runs V2, the trainer calls that same kernel; elsewhere V1's division, which is also what V2's kernel
computes in Triton's interpreter (``tests/test_v2_runner.py``: bit-identical). Torch's ``tensor / python_float``
would be neither on CUDA: it multiplies by the reciprocal.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .distribution import V2_RUNNER

V2_TEMPERATURE_MODULE = "vllm.v1.worker.gpu.sample.gumbel"


@functools.cache
def v2_kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """vLLM's V2 temperature kernel (in place; it skips rows at temperature 0 or 1), or None where this vLLM has none
    or no Triton driver to compile it."""
    try:
        import importlib

        from vllm.triton_utils import HAS_TRITON

        module = importlib.import_module(V2_TEMPERATURE_MODULE)
    except ImportError:
        return None
    return getattr(module, "apply_temperature", None) if HAS_TRITON else None


def uses_v2_kernel(runner: str, device: torch.device) -> bool:
    """The trainer runs V2's compiled kernel: the engine runs V2 and these logits are on a GPU that compiles it."""
    return runner == V2_RUNNER and device.type == "cuda" and v2_kernel() is not None


def apply(logits: torch.Tensor, temperatures: torch.Tensor, runner: str) -> torch.Tensor:
    """``logits`` [rows, vocabulary] float32, contiguous, divided in place by ``temperatures`` [rows] float32 (on
    the logits' device) with the engine's arithmetic. Returns ``logits``."""
    if uses_v2_kernel(runner, logits.device):
        kernel = v2_kernel()
        assert kernel is not None
        mapping = torch.arange(logits.size(0), dtype=torch.int32, device=logits.device)  # request i -> state i
        kernel(logits, mapping, temperatures)
        return logits
    from vllm.v1.sample.sampler import Sampler

    return Sampler.apply_temperature(logits, temperatures, True)


def apply_scalar(logits: torch.Tensor, temperature: float, runner: str) -> torch.Tensor:
    """``apply`` with one temperature for every row; nothing is done at temperature 1 (both runners skip it)."""
    if temperature == 1.0:
        return logits
    temperatures = torch.full((logits.size(0),), temperature, dtype=torch.float32, device=logits.device)
    return apply(logits, temperatures, runner)
