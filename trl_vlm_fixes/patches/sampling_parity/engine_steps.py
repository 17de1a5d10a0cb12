"""The engine's temperature, min-p and log-softmax steps, applied to the trainer's float32 logits with the arithmetic
the engine ran: their last bits decide vLLM's approximate top-p cut and min-p's boundary token, and the log-softmax's
rounding adds up over a completion, so the trainer runs the engine's own functions and kernels, not a division, a
threshold or a log-softmax of its own.

vLLM's V1 sampler divides each row by its request's float32 temperature tensor (``Sampler.apply_temperature``: IEEE
division on every device) and cuts min-p with its ``MinPLogitsProcessor`` (prob < min_p * max prob). The V2 model
runner does both in Triton kernels (``vllm/v1/worker/gpu/sample/gumbel.py``'s ``apply_temperature``, ``min_p.py``'s
``apply_min_p``: logit < max logit + log(min_p)). Compiled for CUDA, Triton's float32 ``/`` is an approximate
division (measured on an H100, docs/gpu-results.md section 14: a multiplication by the reciprocal, one ulp from IEEE
division in many elements), which moved the top-p kernel's cut by 5-8 tokens in some rows (up to 0.027 nats per
token), and ``tl.log`` may be approximate too. So on CUDA, where the engine runs V2, the trainer calls those same
kernels; elsewhere V1's division (which is what V2's kernel computes in Triton's interpreter, bit for bit:
``tests/test_v2_runner.py``) and V2's min-p rule in torch's float32. Torch's ``tensor / python_float`` would be
neither on CUDA: it multiplies by the reciprocal.

The log-prob the engine reports: V1's ``Sampler.compute_logprobs`` (torch's ``log_softmax`` of its float32 logits),
V2's ``compute_token_logprobs`` (a Triton kernel: block sums of Triton's ``exp``). On an H100 (docs/gpu-results.md
section 17) they round differently by a one-signed 1-3e-7 nats per token on a trained spread (torch's float32 sum
loses small terms beside the largest: 5.7e-4 of a 2,048-token completion's weight at 248,320 tokens; V2's sum is
unbiased), and neither equals a third arithmetic (a one-pass kernel, TRL 1.16's online log-sum-exp) within 1e-4 of
the weight at 2,048 tokens; the function itself on the same float32 values gives the same bits. On CUDA, V1's is
read from the model's logits by ``v1_log_softmax``'s kernel (torch's summation order, no float32 copy) once it gave
torch's own bits at positions spread over the first call it reads for that vocabulary (``read_by_kernel``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ...log_once import warn_once
from ...logs import fix_logger
from . import v1_log_softmax, v2_log_softmax
from .distribution import V1_RUNNER, V2_RUNNER

V2_SAMPLE = "vllm.v1.worker.gpu.sample"
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
LOGGER = fix_logger("trl_vlm_fixes.patches.sampling_parity")
CHECK_POSITIONS = 64  # positions of the first call checked bit for bit before the kernel is trusted
KERNEL_DEVICE_TYPES = frozenset({"cuda"})  # where V1's log-softmax is torch's CUDA kernel (the kernel's order)


@functools.cache
def _v2_module(name: str) -> Any:
    """One of V2's sampling modules where its kernels compile (vLLM has Triton), else None."""
    try:
        from vllm.triton_utils import HAS_TRITON

        return importlib.import_module(f"{V2_SAMPLE}.{name}") if HAS_TRITON else None
    except ImportError:
        return None


def v2_kernel() -> Kernel | None:
    """vLLM's V2 temperature kernel (in place; it skips rows at temperature 0 or 1), or None."""
    return getattr(_v2_module("gumbel"), "apply_temperature", None)


def v2_min_p_kernel() -> Kernel | None:
    """vLLM's V2 min-p kernel (in place; it skips rows whose min_p is 0), or None."""
    return getattr(_v2_module("min_p"), "apply_min_p", None)


def v2_log_prob_kernel() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """vLLM's V2 ``compute_token_logprobs`` (float32 logits [rows, vocabulary], ids [rows, k] -> [rows, k]), or None."""
    return getattr(_v2_module("logprob"), "compute_token_logprobs", None)


def uses_v2_kernel(runner: str, device: torch.device) -> bool:
    """The trainer runs V2's compiled kernels: the engine runs V2 and these logits are on a GPU that compiles them."""
    return runner == V2_RUNNER and device.type == "cuda" and v2_kernel() is not None


def _run(kernel: Kernel | None, logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One of V2's kernels on ``logits`` [rows, vocabulary], request i -> state i, in place."""
    assert kernel is not None and logits.stride(1) == 1, "V2's kernels read each row at its stride, columns packed"
    mapping = torch.arange(logits.size(0), dtype=torch.int32, device=logits.device)
    with _current(logits.device):
        kernel(logits, mapping, values)
    return logits


def apply(logits: torch.Tensor, temperatures: torch.Tensor, runner: str) -> torch.Tensor:
    """``logits`` [rows, vocabulary] float32 divided in place by ``temperatures`` [rows] float32 (on the logits'
    device) with the engine's arithmetic. Returns ``logits``."""
    if uses_v2_kernel(runner, logits.device):
        return _run(v2_kernel(), logits, temperatures)
    from vllm.v1.sample.sampler import Sampler

    return Sampler.apply_temperature(logits, temperatures, True)


def apply_scalar(logits: torch.Tensor, temperature: float, runner: str) -> torch.Tensor:
    """``apply`` with one temperature for every row; nothing is done at temperature 1 (both runners skip it)."""
    if temperature == 1.0:
        return logits
    temperatures = torch.full((logits.size(0),), temperature, dtype=torch.float32, device=logits.device)
    return apply(logits, temperatures, runner)


def log_probs(logits: torch.Tensor, ids: torch.Tensor, runner: str) -> torch.Tensor:
    """[rows] the float32 log-prob of each row's token ``ids`` [rows] under ``logits`` [rows, vocabulary] (float32,
    after the engine's steps), with the engine's own log-softmax: V2's kernel on CUDA where the engine runs V2, else
    V1's ``log_softmax`` (on the CPU, torch's is the arithmetic the engine stand-in and vLLM's CPU sampler report)."""
    kernel = v2_log_prob_kernel() if uses_v2_kernel(runner, logits.device) else None
    if kernel is not None:
        with _current(logits.device):
            return kernel(logits.contiguous(), ids.unsqueeze(1)).squeeze(1)
    return torch.log_softmax(logits, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)


def logit_min_p(logits: torch.Tensor, min_p: float, runner: str) -> torch.Tensor:
    """V2's min-p (a token whose float32 logit, after the temperature, is below the row's largest plus
    ``log(min_p)`` is cut), in place: V2's own kernel on CUDA, its rule in torch's float32 elsewhere."""
    if uses_v2_kernel(runner, logits.device) and v2_min_p_kernel() is not None:
        values = torch.full((logits.size(0),), min_p, dtype=torch.float32, device=logits.device)
        return _run(v2_min_p_kernel(), logits, values)
    log_min_p = torch.log(torch.tensor(min_p, dtype=torch.float32))  # float32's log, as the kernel's tl.log of min_p
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p.to(logits.device)
    return logits.masked_fill_(logits < threshold, -math.inf)


def copied_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, runner: str) -> torch.Tensor:
    """[rows] the engine's float32 log-prob of each row's token ``ids`` under ``logits`` [rows, vocabulary] (any
    float dtype; never modified) at ``temperature``: a float32 copy, the ``runner``'s temperature step, its
    log-softmax."""
    values = logits.to(torch.float32, copy=True)
    return log_probs(apply_scalar(values, temperature, runner), ids, runner)


def read_by_kernel(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, runner: str, rows: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``copied_log_probs`` of the positions ``rows`` (flat indices over ``logits``' leading dimensions; all where
    None), read from ``logits`` [..., vocabulary] themselves by the runner's kernel (``v1_log_softmax``: torch's
    order; ``v2_log_softmax``: V2's own kernel reading bf16) where the logits are on CUDA, V2's kernels run there
    (for V2), the kernel can read these logits (checked at every call, on the host) and it gave the engine's bits
    there (``_kernel_trusted``); else None (the caller copies). A trusted kernel that raises on a later call (another
    build, for strides it had not met) is not used again for its key, said once: the copy runs."""
    if logits.device.type not in KERNEL_DEVICE_TYPES or torch.version.hip is not None:
        return None  # (ROCm's torch reports "cuda" devices and sums in its own order)
    if runner == V2_RUNNER and not uses_v2_kernel(runner, logits.device):
        return None  # the copy runs torch's log_softmax: not what the V2 kernel computes
    reader = READERS[runner]
    key = (runner, logits.device, logits.dtype, logits.size(-1), temperature != 1.0)
    why = reader.kernel_fits(logits.size(-1)) or reader.unreadable(logits)
    if why:
        _say_not_used(key, why)
        return None
    if not _kernel_trusted(key, logits, ids, temperature, rows):
        return None
    try:
        with _current(logits.device):
            return reader.kernel_log_probs(logits, ids, temperature, rows)
    except torch.cuda.OutOfMemoryError:
        raise  # the copy needs more memory than the kernel's output; a later call may read by kernel again
    except Exception as error:  # noqa: BLE001 - a later build that fails (new strides, a full cache): the copy
        _verdicts[key] = False
        _say_not_used(key, f"it failed on a later call ({_brief(error)})")
        return None


def _current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` made the current CUDA device: Triton launches its kernels there."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _positions(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[len(index), vocabulary]: the logits at flat positions ``index`` over the leading dimensions, gathered
    without reshaping the whole tensor (a strided view of TRL's logits would be copied whole)."""
    leading = logits.shape[:-1]
    if len(leading) == 1:
        return logits[index]
    return logits[torch.unravel_index(index, leading)]


READERS = {V1_RUNNER: v1_log_softmax, V2_RUNNER: v2_log_softmax}  # each runner's kernel reading bf16 logits
ENGINE_FUNCTIONS = {V1_RUNNER: "torch's log_softmax", V2_RUNNER: "V2's log-softmax kernel"}
RUNNER_NAMES = {V1_RUNNER: "V1", V2_RUNNER: "V2"}
BYTES_COPIED = {V1_RUNNER: "22", V2_RUNNER: "14 to 22"}  # per logit: the float32 copy, its reads, the output
VerdictKey = tuple[str, torch.device, torch.dtype, int, bool]  # runner, device, dtype, vocabulary, temperature != 1
_verdicts: dict[VerdictKey, bool] = {}


def _kernel_trusted(
    key: VerdictKey, logits: torch.Tensor, ids: torch.Tensor, temperature: float, rows: torch.Tensor | None
) -> bool:
    """The runner's kernel gave the engine's own bits for ``key`` (runner, device, dtype, vocabulary, kind of
    temperature: 1, or a division): decided on ``CHECK_POSITIONS`` positions spread over the first call with that many
    and finite values (on TRL 1.16's fused head, its first chunk of projected positions), each at its likeliest token
    and at its own (one read back to the host, once); where it did not, or could not run, the float32 copy runs from
    then on and one WARNING says why."""
    if key in _verdicts:
        return _verdicts[key]
    runner = key[0]
    count = logits.numel() // logits.size(-1) if rows is None else rows.numel()
    if count < CHECK_POSITIONS:
        return False  # too few positions to judge: the copy this time
    # positions spread over the call; each one's likeliest token, whose log-prob (near 0) keeps the row sum's last
    # bits (a drawn token's, some nats down, rounds most of them away)
    spread = torch.linspace(0, count - 1, CHECK_POSITIONS, device=logits.device).long()
    head = spread if rows is None else rows[spread]
    checked = _positions(logits, head)
    # each position twice: at its likeliest token and at the call's own (a log-prob some nats below 0: the final
    # subtraction with a logit below the max)
    head, chosen = head.repeat(2), torch.cat([checked.argmax(dim=-1), ids.reshape(-1)[spread]])
    checked = checked.repeat(2, 1)
    try:
        with _current(logits.device):
            fast = READERS[runner].kernel_log_probs(logits, chosen, temperature, head)
    except Exception as error:  # noqa: BLE001 - a Triton or driver that cannot build it: the copy, said once
        _verdicts[key] = False
        _say_not_used(key, f"the kernel could not run ({_brief(error)})")
        return False
    reference = copied_log_probs(checked, chosen, temperature, runner)
    # bit patterns; and a check over non-finite values (a NaN row is NaN on both sides) proves nothing: no verdict
    differing, finite = (
        int(value)
        for value in torch.stack(
            [(fast.view(torch.int32) != reference.view(torch.int32)).sum(), torch.isfinite(reference).sum()]
        ).tolist()
    )  # the one read back to the host
    if finite < reference.numel() and not differing:
        return False  # the copy this time; the next call with finite values decides
    _verdicts[key] = differing == 0
    if differing:
        _say_not_used(
            key, f"it differs from {ENGINE_FUNCTIONS[runner]} in {differing} of {reference.numel()} log-probs"
        )
    else:
        warn_once(
            ("sampling_parity", "kernel", key),
            "%s's log-prob is read from the model's logits by the fix's kernel (at %d positions its log-probs of the "
            "likeliest and the sampled token had the bits of %s, %d tokens, %s): no float32 copy",
            RUNNER_NAMES[runner],
            CHECK_POSITIONS,
            ENGINE_FUNCTIONS[runner],
            key[3],
            logits.device,
            logger=LOGGER,
            level=logging.INFO,
        )
    return _verdicts[key]


def _brief(error: Exception) -> str:
    """An error for a log line: its type and the start of its message (a compiler's can run to kilobytes)."""
    message = str(error)
    return f"{type(error).__name__}: {message[:300]}{' ...' if len(message) > 300 else ''}"


def _say_not_used(key: VerdictKey, why: str) -> None:
    """One WARNING per key and reason (a reason checked at every call is said once, also after a verdict)."""
    warn_once(
        ("sampling_parity", "kernel not used", key, why),
        "%s's log-prob is computed with %s on a float32 copy of the logits (exact; about %s bytes moved per logit "
        "instead of 4): the fix's kernel was not used because %s",
        RUNNER_NAMES[key[0]],
        ENGINE_FUNCTIONS[key[0]],
        BYTES_COPIED[key[0]],
        why,
        logger=LOGGER,
    )
