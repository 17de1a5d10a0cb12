"""The float32 log-prob of each scored token, read once from TRL's logits on the GPU: one Triton program per
position, no float32 copy of the logits.

Where nothing is cut (a ban at most) and TRL's logits are read (TRL 1.9.1), the fix's log-prob is vLLM's float32
``log_softmax`` of the logits at the sampling temperature. In torch that is a float32 copy of each chunk and a
log-softmax over it, four to five passes over memory per position: on an H100 at 16 x 1,024 positions and 248,320
tokens, 9.7% of TRL's scoring pass with nothing cut and 14.7% with the placeholder ban (docs/gpu-results.md). This
kernel reads each position's bf16 (or float32) logits twice (the maximum, then the sum of exponentials), in float32,
with the engine's temperature step (IEEE division where the engine runs V1, Triton's ``/`` as V2's own temperature
kernel where it runs V2; nothing at temperature 1, as both skip it), and with a ban it sums the kept tokens in the same
pass, so the kept share is exact without the torch path's search for positions where the ban holds most of the mass
(a host sync). Compiled, it uses libdevice's ``exp``/``log`` (torch's accuracy: Triton's own float32 ``exp`` is an
approximation whose error would not average out over thousands of tokens); in Triton's interpreter (the tests) numpy's.

Same formula as torch's log-softmax (``x - max - log(sum(exp(x - max)))``); only the order of the sum differs: a few
1e-8 nats per token, either sign. The kernel is built on first use where the logits are on a CUDA device and Triton
compiles (``kernel()``), else the torch path runs; tests pass an interpreted build to ``log_probs``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch

from ...logs import fix_logger
from .distribution import V2_RUNNER

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - every stack the fix supports has Triton beside torch
    triton = tl = libdevice = None

BLOCK = 4096  # logits per step of a program (a power of two)
_logger = fix_logger(__name__)


class Verdict:
    """Whether this process uses the compiled kernel: judged once, on its first call, against the torch path on the
    same positions (float32 rounding gives gaps of ~1e-6 nats, either sign; a wrong build far more, or a one-signed
    gap such as an approximate ``exp`` would give), or refused where it failed to build or run. A refusal is one
    WARNING, and the torch path (same values, more passes over memory) from then on."""

    TOLERANCE = 1e-4  # nats per token
    BIAS = 5e-8  # nats per token, on average
    MINIMUM = 64  # scored positions a verdict needs

    def __init__(self) -> None:
        self.trusted: bool | None = None

    def judge(
        self,
        fused: tuple[torch.Tensor, torch.Tensor],
        torch_path: tuple[torch.Tensor, torch.Tensor],
        scored: torch.Tensor,
    ) -> None:
        """Compare (log-prob, log of the kept share) of both paths at the ``scored`` positions (fewer than
        ``MINIMUM``: no verdict yet)."""
        count = int(scored.sum())
        if count < self.MINIMUM:  # too few for a mean: the torch path this call, the verdict at a larger one
            return
        gaps = [(ours - theirs)[scored].double() for ours, theirs in zip(fused, torch_path, strict=True)]
        worst = float(torch.stack([gap.abs().max() for gap in gaps]).max())
        # a one-signed gap adds up over a completion: the log-probs' mean gap must be within the noise of a sum's order
        # (a few 1e-7 per token, either sign) and below 5e-8, the IS weight moving by 1e-4 at 2,048 tokens
        bias = abs(float(gaps[0].mean()))
        noise = 4 * float(gaps[0].std()) / math.sqrt(count) if count > 1 else 0.0
        if math.isfinite(worst) and worst <= self.TOLERANCE and bias <= self.BIAS + noise:
            self.trusted = True
            _logger.info(
                "the one-pass float32 log-prob kernel agrees with the torch path on its first %d positions "
                "(largest gap %.2g nats): it scores from now on",
                count,
                worst,
            )
        else:
            self.refuse(
                f"its log-probs differ from the torch path's by up to {worst:.3g} nats (mean {bias:.2g}) on its first "
                f"{count} positions"
            )

    def refuse(self, reason: str) -> None:
        self.trusted = False
        _logger.warning(
            "the one-pass float32 log-prob kernel is not used in this process: %s; the torch path scores instead "
            "(the same log-probs, more passes over the logits)",
            reason,
        )


verdict = Verdict()


def body(  # type: ignore[no-untyped-def]  # Triton resolves annotations: only tl.constexpr ones
    logits_ptr,
    row_stride,
    position_stride,
    width,
    lengths_ptr,
    ids_ptr,
    banned_ptr,
    temperature,
    plain_ptr,
    kept_ptr,
    log_kept_ptr,
    vocabulary,
    BANNED: tl.constexpr,  # how many banned ids
    SCALE: tl.constexpr,  # 0 none (temperature 1), 1 IEEE division (V1), 2 Triton's division (V2's kernel)
    ACCURATE: tl.constexpr,  # libdevice's exp/log (compiled, CUDA); numpy's in the interpreter (CPU tensors)
    BLOCK_SIZE: tl.constexpr,
):
    """One scored position: row ``program_id // width``, position ``program_id % width``; past its row's length,
    NaN (the padding after a completion ended keeps TRL's own log-prob)."""
    program = tl.program_id(0).to(tl.int64)
    row = program // width
    position = program % width
    if position >= tl.load(lengths_ptr + row):
        tl.store(plain_ptr + program, float("nan"))
        tl.store(kept_ptr + program, float("nan"))
        tl.store(log_kept_ptr + program, float("nan"))
        return
    base = logits_ptr + row * row_stride + position * position_stride
    token = tl.load(ids_ptr + program).to(tl.int64)
    largest = tl.full([BLOCK_SIZE], float("-inf"), tl.float32)
    for start in range(0, vocabulary, BLOCK_SIZE):
        columns = start + tl.arange(0, BLOCK_SIZE)
        values = tl.load(base + columns, mask=columns < vocabulary, other=float("-inf")).to(tl.float32)
        if SCALE == 1:
            values = tl.math.div_rn(values, temperature)
        elif SCALE == 2:
            values = values / temperature
        largest = tl.maximum(largest, values)
    top = tl.max(largest, axis=0)
    total = tl.zeros([BLOCK_SIZE], tl.float32)
    kept = tl.zeros([BLOCK_SIZE], tl.float32)
    for start in range(0, vocabulary, BLOCK_SIZE):
        columns = start + tl.arange(0, BLOCK_SIZE)
        values = tl.load(base + columns, mask=columns < vocabulary, other=float("-inf")).to(tl.float32)
        if SCALE == 1:
            values = tl.math.div_rn(values, temperature)
        elif SCALE == 2:
            values = values / temperature
        shares = libdevice.exp(values - top) if ACCURATE else tl.exp(values - top)
        total += shares
        if BANNED > 0:
            banned = columns < 0  # all False
            for index in tl.static_range(BANNED):
                banned = banned | (columns == tl.load(banned_ptr + index))
            kept += tl.where(banned & (columns != token), 0.0, shares)  # the sampled token is always kept
    sampled = tl.load(base + token).to(tl.float32)
    if SCALE == 1:
        sampled = tl.math.div_rn(sampled, temperature)
    elif SCALE == 2:
        sampled = sampled / temperature
    log_total = libdevice.log(tl.sum(total, axis=0)) if ACCURATE else tl.log(tl.sum(total, axis=0))
    tl.store(plain_ptr + program, sampled - top - log_total)
    if BANNED > 0:
        log_kept = libdevice.log(tl.sum(kept, axis=0)) if ACCURATE else tl.log(tl.sum(kept, axis=0))
        tl.store(kept_ptr + program, sampled - top - log_kept)
        tl.store(log_kept_ptr + program, log_kept - log_total)


@functools.cache
def _compiled() -> Any:
    return triton.jit(body)


def kernel(logits: torch.Tensor) -> Any | None:
    """The compiled kernel where these logits can take it (a CUDA tensor, Triton present), else None."""
    if triton is None or not logits.is_cuda:
        return None
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return None
    return _compiled() if HAS_TRITON else None


def log_probs(
    kernel: Any,
    logits: torch.Tensor,
    ids: torch.Tensor,
    lengths: list[int] | None,
    temperature: float,
    runner: str,
    banned: tuple[int, ...] = (),
    accurate: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``logits`` [rows, positions, vocabulary] (any float dtype, columns packed; a view of TRL's) and the sampled
    ``ids`` [rows * positions]: (plain, kept, log_kept) [rows * positions] float32: the log-prob of each token under
    the plain distribution at ``temperature``, under the distribution without ``banned`` (the sampled token kept), and
    the log of the kept share; NaN past each row's length (``lengths``; all positions without). Without a ban, kept is
    plain and log_kept 0. ``accurate``: libdevice's exp/log (default on CUDA tensors) or Triton's own (what V2's
    log-softmax kernel uses; a GPU record compares both)."""
    rows, width, vocabulary = logits.shape
    assert logits.stride(2) == 1, "each position's logits are read as one packed row"
    device = logits.device
    count = rows * width
    plain = torch.empty(count, dtype=torch.float32, device=device)
    kept = torch.empty_like(plain) if banned else plain
    log_kept = torch.empty_like(plain) if banned else torch.zeros_like(plain)
    ends = torch.tensor(lengths if lengths is not None else [width] * rows, dtype=torch.int64, device=device)
    banned_ids = torch.tensor(banned or (0,), dtype=torch.int64, device=device)
    scale = 0 if temperature == 1.0 else 2 if runner == V2_RUNNER else 1
    if not count:
        return plain, kept, log_kept
    with torch.cuda.device(device) if logits.is_cuda else contextlib.nullcontext():  # Triton launches on the current
        kernel[(count,)](
            logits,
            logits.stride(0),
            logits.stride(1),
            width,
            ends,
            ids.to(dtype=torch.int64).contiguous(),
            banned_ids,
            float(torch.tensor(temperature, dtype=torch.float32)),  # the request's float32 temperature, as vLLM's
            plain,
            kept,
            log_kept,
            vocabulary,
            BANNED=len(banned),
            SCALE=scale,
            ACCURATE=logits.is_cuda if accurate is None else accurate,
            BLOCK_SIZE=min(BLOCK, triton.next_power_of_2(vocabulary)),
        )
    return plain, kept, log_kept
