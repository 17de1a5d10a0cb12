"""vLLM V2's reported log-prob (``compute_token_logprobs``'s Triton kernel on the float32 logits after V2's temperature
kernel), read straight from the model's bf16 logits: the same bits without the float32 copy.

V2's sampler copies the logits to float32, divides them by the temperature in place (``gumbel.py``'s
``_temperature_kernel``: Triton's ``/``) and reports each sampled token's log-prob from ``logprob.py``'s
``_topk_log_softmax_kernel``: a max pass and a sum pass over blocks of 1,024 logits, each block's exps summed by
``tl.sum``. The trainer's copy of that (``engine_steps.copied_log_probs``) writes a float32 copy of every scored logit
and reads it twice: 8.6% of a 2B model's scoring pass at 248,320 tokens on an H100 (docs/gpu-results.md section 17).

This kernel is V2's, line for line, with differences that leave the arithmetic as it was: it reads each position at
an int64 offset (TRL's strided logits, TRL 1.16's products); it upcasts the bf16 logits it loads (exact) and divides
them by the temperature with the same ``/`` as V2's temperature kernel, in registers (skipped at 0 and 1, as V2's
kernel returns early there); it tells Triton that each position starts at a multiple of 4 logits, no more; and it is
compiled without floating-point fusion. ``tl.sum``'s order is the order of the tensor's layout (which logits each
thread holds, then the shuffle tree), and Triton picks the layout from the load: 128 bits a thread, 4 float32 values
from V2's float32 copy but 8 bf16 values from the model's logits, another order; aligned to 4 logits, the bf16 load
gets the float32 copy's layout, so the sum sees the same values in the same order. V2 rounds each quotient when its
temperature kernel stores it; compiled with fusion, ptxas folded the division's last multiply and the subtraction of
the max into one FFMA (one rounding: other bits at T = 0.7 on an H200). Checked where it runs: the kernels' compiled
layouts, divisions and fused multiply-adds compared for an H100 (tests/test_v2_log_softmax.py); and bit for bit
against V2's own kernels on the GPU before it is used (``engine_steps.read_by_kernel``).
"""

from __future__ import annotations

from typing import Any

import torch

from .v1_log_softmax import launched

BLOCK_SIZE = 1024  # V2's compute_token_logprobs (BLOCK_SIZE=1024)
PER_THREAD = 4  # float32 values per thread in the layout Triton gives V2's float32 load (128 bits)
SPECIALIZED = 16  # Triton marks an integer argument divisible by 16 (V2's row stride) as such: 128-bit loads follow
ALIGNMENT = 16  # bytes: Triton marks a pointer so aligned as such (the float32 copy's are), which the layout needs

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the float32 copy runs
    triton = None


def kernel_fits(vocabulary: int) -> str | None:
    """Why this kernel's layout would not be V2's for rows of ``vocabulary`` float32 logits, or None."""
    if vocabulary % SPECIALIZED:
        return (
            f"V2's float32 rows of {vocabulary} logits are not marked 16-aligned by Triton (its load takes another "
            "layout)"
        )
    if triton is None:
        return "Triton is not importable"
    return None


def unreadable(logits: torch.Tensor) -> str | None:
    """Why the kernel cannot read ``logits`` [..., vocabulary] in place in V2's layout, or None: each position's
    logits packed, starting at a multiple of ``PER_THREAD`` logits of a 16-byte aligned tensor (what the kernel tells
    Triton), in a dtype of at most 4 bytes (a float64 load takes 2 values a thread)."""
    if logits.stride(-1) != 1:
        return "the logits are not packed"
    if logits.element_size() > 4:
        return f"{logits.dtype} logits load in another layout"
    steps = [stride for size, stride in zip(logits.shape[:-1], logits.stride()[:-1], strict=True) if size > 1]
    if any(stride % PER_THREAD for stride in steps) or logits.data_ptr() % ALIGNMENT:
        return f"the positions do not start at multiples of {PER_THREAD} logits of a {ALIGNMENT}-byte aligned tensor"
    return None


if triton is not None:

    @triton.jit
    def _scaled(x, temperature, SCALE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads the signature
        if SCALE:
            x = x / temperature  # V2's _temperature_kernel: Triton's float32 division
        return x

    @triton.jit
    def _v2_log_prob_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
        out_ptr,
        logits_ptr,
        offsets_ptr,
        ids_ptr,
        temperature,
        vocab_size,
        SCALE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        PER_THREAD: tl.constexpr,
    ):
        row = tl.program_id(0)
        # aligned to PER_THREAD logits, no more: the layout of V2's float32 load, not the 8 values a thread bf16 gets
        row_ptr = logits_ptr + tl.multiple_of(tl.load(offsets_ptr + row), PER_THREAD)

        max_val = float("-inf")
        for i in range(0, vocab_size, BLOCK_SIZE):
            block = i + tl.arange(0, BLOCK_SIZE)
            logits = tl.load(row_ptr + block, mask=block < vocab_size, other=float("-inf")).to(tl.float32)
            logits = _scaled(logits, temperature, SCALE)
            max_val = tl.max(tl.maximum(logits, max_val))
        max_val = max_val.to(tl.float32)  # type: ignore[attr-defined]  # a tensor by now (as in V2's kernel)

        se = 0.0
        for i in range(0, vocab_size, BLOCK_SIZE):
            block = i + tl.arange(0, BLOCK_SIZE)
            logits = tl.load(row_ptr + block, mask=block < vocab_size, other=0.0).to(tl.float32)
            logits = _scaled(logits, temperature, SCALE)
            e = tl.exp(logits - max_val)
            e = tl.where(block < vocab_size, e, 0.0)
            se += tl.sum(e)
        lse = tl.log(se)

        token = tl.load(ids_ptr + row + tl.arange(0, 1))  # [1]: a tensor, as V2's gather
        chosen = _scaled(tl.load(row_ptr + token).to(tl.float32), temperature, SCALE)
        tl.store(out_ptr + row + tl.arange(0, 1), chosen - max_val - lse)


def kernel_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, rows: torch.Tensor | None = None, kernel: Any = None
) -> torch.Tensor:
    """[positions] V2's log-prob of each position's token ``ids`` [positions] under ``logits`` [..., vocabulary]
    (bf16, fp16 or float32, readable: ``unreadable``; never copied) at ``temperature``. ``rows``: the flat indices
    (over ``logits``' leading dimensions) of the positions to score, all where None. ``kernel``: another build of the
    kernel (the tests' interpreted copy)."""
    why = kernel_fits(logits.size(-1)) or unreadable(logits)
    if why is not None:
        raise ValueError(why)
    return launched(
        kernel or _v2_log_prob_kernel,
        logits,
        ids,
        temperature,
        rows,
        SCALE=temperature not in (0.0, 1.0),  # V2's temperature kernel returns early at 0 and 1
        BLOCK_SIZE=BLOCK_SIZE,
        PER_THREAD=PER_THREAD,
        enable_fp_fusion=False,  # V2 rounds each quotient (stored) before subtracting; num_warps: V2's default, 4
    )
