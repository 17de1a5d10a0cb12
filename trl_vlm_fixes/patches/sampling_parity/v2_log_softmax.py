"""vLLM V2's reported log-prob (``compute_token_logprobs``'s Triton kernel on the float32 logits after V2's temperature
kernel), read straight from the model's bf16 logits: the same bits without the float32 copy.

V2's sampler copies the logits to float32, divides them by the temperature in place (``gumbel.py``'s
``_temperature_kernel``: Triton's ``/``) and reports each sampled token's log-prob from ``logprob.py``'s
``_topk_log_softmax_kernel``: a max pass and a sum pass over blocks of 1,024 logits, each block's exps summed by
``tl.sum``. The trainer's copy of that (``engine_steps.copied_log_probs``) writes a float32 copy of every scored logit
and reads it twice: 8.6% of a 2B model's scoring pass at 248,320 tokens on an H100 (docs/gpu-results.md section 17).

This kernel is V2's, line for line, with three differences that leave the arithmetic as it was: it reads each position
at an int64 offset (TRL's strided logits, TRL 1.16's products); it upcasts the bf16 logits it loads (exact) and
divides them by the temperature with the same ``/`` as V2's temperature kernel, in registers; and it tells Triton
that each position starts at a multiple of 4 logits and that runs of 4 logits are contiguous, no more (either caps
the load at 4 values a thread). ``tl.sum``'s order is the order of the tensor's layout (which
logits each thread holds, then the shuffle tree), and Triton picks the layout from the load: 128 bits a thread,
4 float32 values from V2's float32 copy but 8 bf16 values from the model's logits, another order. With runs of 4, the
bf16 load gets the float32 copy's layout, so the sum sees the same values in the same order (checked where it runs:
the kernels' compiled layouts compared for an H100, tests/test_v2_log_softmax.py; and bit for bit against V2's own
kernel on the GPU before it is used, ``engine_steps.read_by_kernel``).
"""

from __future__ import annotations

from typing import Any

import torch

from .v1_log_softmax import position_offsets

BLOCK_SIZE = 1024  # V2's compute_token_logprobs (BLOCK_SIZE=1024)
PER_THREAD = 4  # float32 values per thread in the layout Triton gives V2's float32 load (128 bits)
SPECIALIZED = 16  # Triton marks an integer argument divisible by 16 (V2's row stride) as such: 128-bit loads follow

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


if triton is not None:

    @triton.jit
    def _scaled(x, temperature, SCALE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads the signature
        if SCALE:
            x = x / temperature  # V2's _temperature_kernel: Triton's float32 division
        return x

    @triton.jit
    def _minus(a, b):  # type: ignore[no-untyped-def]  # Triton reads the signature
        """``a - b`` rounded on its own (PTX's ``sub.rn`` is never fused): where ``a`` is a quotient, ptxas would fold
        the division's last multiply and a plain subtraction into one FFMA, one rounding where V2 rounds twice (its
        temperature kernel stores the quotient; seen in the SASS for an H100 and as other bits on an H200)."""
        return tl.inline_asm_elementwise(
            "sub.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )

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
        row_ptr = logits_ptr + tl.multiple_of(tl.load(offsets_ptr + row), PER_THREAD)

        max_val = float("-inf")
        for i in range(0, vocab_size, BLOCK_SIZE):
            # runs of PER_THREAD: the layout of V2's float32 load, not the 8 values a thread a bf16 load gets
            block = tl.max_contiguous(tl.multiple_of(i + tl.arange(0, BLOCK_SIZE), PER_THREAD), PER_THREAD)
            logits = tl.load(row_ptr + block, mask=block < vocab_size, other=float("-inf")).to(tl.float32)
            logits = _scaled(logits, temperature, SCALE)
            max_val = tl.max(tl.maximum(logits, max_val))
        max_val = max_val.to(tl.float32)  # type: ignore[attr-defined]  # a tensor by now (as in V2's kernel)

        se = 0.0
        for i in range(0, vocab_size, BLOCK_SIZE):
            block = tl.max_contiguous(tl.multiple_of(i + tl.arange(0, BLOCK_SIZE), PER_THREAD), PER_THREAD)
            logits = tl.load(row_ptr + block, mask=block < vocab_size, other=0.0).to(tl.float32)
            logits = _scaled(logits, temperature, SCALE)
            e = tl.exp(_minus(logits, max_val))
            e = tl.where(block < vocab_size, e, 0.0)
            se += tl.sum(e)
        lse = tl.log(se)

        token = tl.load(ids_ptr + row + tl.arange(0, 1))  # [1]: a tensor, as V2's gather and _minus take
        chosen = _scaled(tl.load(row_ptr + token).to(tl.float32), temperature, SCALE)
        tl.store(out_ptr + row + tl.arange(0, 1), _minus(chosen, max_val) - lse)


def kernel_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, rows: torch.Tensor | None = None, kernel: Any = None
) -> torch.Tensor:
    """[positions] V2's log-prob of each position's token ``ids`` [positions] under ``logits`` [..., vocabulary]
    (any float dtype, the vocabulary packed, positions starting at multiples of 4 logits; never copied) at
    ``temperature``. ``rows``: the flat indices (over ``logits``' leading dimensions) of the positions to score, all
    where None. ``kernel``: another build of the kernel (the tests' interpreted copy)."""
    vocabulary = logits.size(-1)
    why = kernel_fits(vocabulary)
    if why is not None:
        raise ValueError(why)
    if logits.stride(-1) != 1:
        raise ValueError("the kernel reads each position's logits packed (stride 1 along the vocabulary)")
    if any(stride % PER_THREAD for stride in logits.stride()[:-1]) or logits.data_ptr() % SPECIALIZED:
        raise ValueError(f"each position's logits must start 16-byte aligned, at a multiple of {PER_THREAD} logits")
    offsets = position_offsets(logits)
    if rows is not None:
        offsets = offsets[rows]
    out = torch.empty(offsets.numel(), dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    launch = (kernel or _v2_log_prob_kernel)[(out.numel(),)]
    launch(
        out,
        logits,
        offsets,
        ids.to(torch.int64).reshape(-1).contiguous(),
        float(temperature),
        vocabulary,
        SCALE=temperature != 1.0,
        BLOCK_SIZE=BLOCK_SIZE,
        PER_THREAD=PER_THREAD,
    )
    return out
