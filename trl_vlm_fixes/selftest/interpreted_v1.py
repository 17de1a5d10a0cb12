"""``v1_log_softmax``'s kernel run by Triton's interpreter, for a machine without a GPU: its own source with
libdevice's ``exp``/``log`` (which the interpreter does not run) read as ``tl.exp``/``tl.log`` (numpy's there), so it
is held to ``emulated_log_probs`` with numpy's functions, bit for bit (``tests/test_v1_log_softmax.py``, the GPU
script's dry run). On a GPU the module's own compiled kernel runs."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..patches.sampling_parity import kernel_copy, v1_log_softmax

# (compiled name, interpreted name): each occurs in the kernel's source
_SUBSTITUTIONS = (("libdevice.exp(", "tl.exp("), ("libdevice.log(", "tl.log("))


@functools.cache
def _namespace() -> dict[str, Any]:
    source = Path(v1_log_softmax.__file__).read_text()
    for compiled, interpreted in _SUBSTITUTIONS:
        if compiled not in source:
            raise RuntimeError(f"v1_log_softmax's kernel no longer calls {compiled}: update the interpreted copy")
        source = source.replace(compiled, interpreted)
    return kernel_copy.executed_in_interpreter(source, "trl_vlm_fixes_v1_log_softmax_interpreted")


def kernel_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """``v1_log_softmax.kernel_log_probs`` with the interpreted kernel (CPU tensors), every position."""
    return kernel_log_probs_at(logits, ids, temperature, None)


def kernel_log_probs_at(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, rows: torch.Tensor | None
) -> torch.Tensor:
    """The same at the flat positions ``rows`` (all where None)."""
    namespace = _namespace()
    with kernel_copy.interpreting():
        return namespace["kernel_log_probs"](logits, ids, temperature, rows, kernel=namespace["_v1_log_prob_kernel"])


def numpy_exp(values: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.exp(values.numpy()))


def numpy_log(values: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.log(values.numpy()))


def emulated_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The order in torch operations with the interpreter's elementwise functions: what the interpreted kernel gives."""
    return v1_log_softmax.emulated_log_probs(logits, ids, temperature, exp=numpy_exp, log=numpy_log)
