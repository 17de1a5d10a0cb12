"""vLLM V1's reported log-prob (torch's CUDA ``log_softmax`` of the float32 logits after the temperature step), read
straight from the model's bf16 logits: the same bits without the float32 copy and the full output.

The engine's float32 log-softmax rounds its row sum one-signed (it loses the small terms beside the largest), so
only its own summation order gives its bits (docs/gpu-results.md section 17). Run as torch runs it, the trainer's
copy costs a float32 copy of every scored logit, three reads of it and a full float32 output: about 22 bytes per
logit, 38 ms per 16,384 positions at 248,320 tokens on an H100 (9.6% of a 2B model's scoring pass). This kernel
follows torch's ``cunn_SoftMaxForward`` (``aten/src/ATen/native/cuda/SoftMax.cu``) for a row of more classes than
fit its shared-memory variant: one block of 1,024 threads a row; each thread folds the float4 vectors at
``4 * (thread + 1024 * k)`` in order, then the tail past the last whole 4,096 one element at a time; max and sum
reduced by warp shuffles (``WarpReduce``: lane i adds lane i + 16, + 8, ... + 1), the 32 warp results by one more
warp; ``log`` of the sum; the logit minus the max minus that log. The float32 values are the bf16 logits upcast
(exact), divided by the temperature with IEEE division (``Sampler.apply_temperature``), so reading bf16 gives the
copy's values: 4 bytes read per logit.

A summation order is torch's build's, not a documented contract, so the kernel is used only after it gave torch's
own bits at positions of the first call for a vocabulary on a device (``engine_steps.read_by_kernel``'s check);
otherwise torch's function on a float32 copy runs, as before, and the reason is logged once. Only the two reads of
each logit remain, as scalar loads (their time on a GPU: benchmarks/gpu/v1_log_softmax.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

BLOCK = 1024  # torch's threads per row for a row of over 1,024 classes (SoftMaxForward_getBlockSize)
ILP = 4  # float32 values per vector load in torch's kernel (sizeof(float4) / sizeof(float))
WARP = 32
# torch keeps a row of fewer float32 classes than this in shared memory (another kernel, another order): 48 KiB of
# shared memory per block less one float per warp, over 4 bytes (cunn_SoftMaxForwardSmem)
SHARED_MEMORY_CLASSES = (48 * 1024 - (BLOCK // WARP) * 4) // 4
LOWEST = -3.4028234663852886e38  # torch's initial max (-numeric_limits<float>::max())

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # no Triton: torch's own function runs
    triton = None


def kernel_fits(vocabulary: int) -> str | None:
    """Why this kernel's order is not torch's for rows of ``vocabulary`` float32 classes, or None."""
    if vocabulary <= SHARED_MEMORY_CLASSES:
        return f"a row of {vocabulary} classes fits torch's shared-memory kernel (another order)"
    if vocabulary % ILP:
        return f"{vocabulary} classes are not a whole number of float4 vectors (torch's rows would be misaligned)"
    if triton is None:
        return "Triton is not importable"
    return None


def unreadable(logits: torch.Tensor) -> str | None:
    """Why the kernel cannot read ``logits`` [..., vocabulary] in place, or None: each position's logits packed."""
    return None if logits.stride(-1) == 1 else "the logits are not packed"


if triton is not None:

    @triton.jit
    def _warp_sum(values, ROWS: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads the signature
        """[ROWS, 32] -> [ROWS]: each row summed as a warp's shuffle-down tree sums its 32 lanes."""
        values = tl.sum(tl.reshape(values, [ROWS, 2, 16]), axis=1)
        values = tl.sum(tl.reshape(values, [ROWS, 2, 8]), axis=1)
        values = tl.sum(tl.reshape(values, [ROWS, 2, 4]), axis=1)
        values = tl.sum(tl.reshape(values, [ROWS, 2, 2]), axis=1)
        values = tl.sum(tl.reshape(values, [ROWS, 2, 1]), axis=1)
        return tl.reshape(values, [ROWS])

    @triton.jit
    def _scaled(x, temperature, SCALE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton reads the signature
        if SCALE:
            x = tl.math.div_rn(x, temperature)  # IEEE division (Triton's / is approximate on CUDA)
        return x

    @triton.jit
    def _v1_log_prob_kernel(  # type: ignore[no-untyped-def]  # Triton reads the signature
        out_ptr,
        logits_ptr,
        offsets_ptr,
        ids_ptr,
        temperature,
        vocabulary,
        FULL: tl.constexpr,
        TAIL: tl.constexpr,
        SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + tl.load(offsets_ptr + row)  # the position's first logit
        lanes = tl.arange(0, BLOCK)
        vectors = (lanes * 4)[:, None] + tl.arange(0, 4)[None, :]  # [thread, j]: element 4 * thread + j
        tail_start = FULL * 4 * BLOCK

        peak = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
        for k in range(FULL):
            x = tl.load(base + k * 4 * BLOCK + vectors).to(tl.float32)
            peak = tl.maximum(peak, tl.max(x, axis=1))
        for k in tl.static_range(TAIL):
            index = tail_start + k * BLOCK + lanes
            last = tl.load(base + index, mask=index < vocabulary, other=float("-inf")).to(tl.float32)
            peak = tl.maximum(peak, last)  # (another name: a loop-carried name keeps one shape)
        # division by a positive temperature is monotonic, so the max of the divided values is the divided max
        top = _scaled(tl.max(peak, axis=0), temperature, SCALE)

        total = tl.zeros([BLOCK], tl.float32)
        for k in range(FULL):
            x = _scaled(tl.load(base + k * 4 * BLOCK + vectors).to(tl.float32), temperature, SCALE)
            terms = libdevice.exp(x - top)
            even, odd = tl.split(tl.reshape(terms, [BLOCK, 2, 2]))  # columns (0, 2) and (1, 3)
            first, third = tl.split(even)
            second, fourth = tl.split(odd)
            total = total + first
            total = total + second
            total = total + third
            total = total + fourth
        for k in tl.static_range(TAIL):
            index = tail_start + k * BLOCK + lanes
            last = tl.load(base + index, mask=index < vocabulary, other=0.0).to(tl.float32)
            last = _scaled(last, temperature, SCALE)
            total = total + tl.where(index < vocabulary, libdevice.exp(last - top), 0.0)
        per_warp = _warp_sum(tl.reshape(total, [BLOCK // 32, 32]), BLOCK // 32)
        row_sum = tl.sum(_warp_sum(tl.reshape(per_warp, [1, BLOCK // 32]), 1), axis=0)

        token = tl.load(ids_ptr + row)
        chosen = _scaled(tl.load(base + token).to(tl.float32), temperature, SCALE)
        tl.store(out_ptr + row, (chosen - top) - libdevice.log(row_sum))


def kernel_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, rows: torch.Tensor | None = None, kernel: Any = None
) -> torch.Tensor:
    """[positions] V1's log-prob of each position's token ``ids`` [positions] under ``logits`` [..., vocabulary]
    (any float dtype, the vocabulary packed; never copied) at ``temperature``, in torch's CUDA order. ``rows``: the
    flat indices (over ``logits``' leading dimensions) of the positions to score, all where None. ``kernel``: another
    build of the kernel (the tests' interpreted copy)."""
    vocabulary = logits.size(-1)
    why = kernel_fits(vocabulary) or unreadable(logits)
    if why is not None:
        raise ValueError(why)
    full = vocabulary // (ILP * BLOCK)
    tail = math.ceil((vocabulary - full * ILP * BLOCK) / BLOCK)
    constants = {"FULL": full, "TAIL": tail, "SCALE": temperature != 1.0, "BLOCK": BLOCK}
    return launched(kernel or _v1_log_prob_kernel, logits, ids, temperature, rows, num_warps=8, **constants)


def launched(
    kernel: Any, logits: torch.Tensor, ids: torch.Tensor, temperature: float, rows: torch.Tensor | None, **options: Any
) -> torch.Tensor:
    """[positions] a reader kernel's log-probs: one program a position of ``rows`` (flat over ``logits``' leading
    dimensions; all where None), launched with the readers' common parameters (output, logits, int64 offsets, token
    ids, temperature, vocabulary) and its own ``options`` (constants, launch options)."""
    offsets = position_offsets(logits)
    if rows is not None:
        offsets = offsets[rows]
    out = torch.empty(offsets.numel(), dtype=torch.float32, device=logits.device)
    if out.numel():
        ids = ids.to(torch.int64).reshape(-1).contiguous()
        kernel[(out.numel(),)](out, logits, offsets, ids, float(temperature), logits.size(-1), **options)
    return out


def position_offsets(logits: torch.Tensor) -> torch.Tensor:
    """[positions] int64: each position's first element, over ``logits``' leading dimensions (flattened)."""
    offsets = torch.zeros((), dtype=torch.int64, device=logits.device)
    for size, stride in zip(logits.shape[:-1], logits.stride()[:-1], strict=True):
        steps = torch.arange(size, dtype=torch.int64, device=logits.device) * stride
        offsets = (offsets.unsqueeze(-1) + steps).reshape(-1)
    return offsets.reshape(-1)


def emulated_log_probs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, exp: Any = torch.exp, log: Any = torch.log
) -> torch.Tensor:
    """The same order in torch operations (slow: one op per vector step): the reference the kernel is held to on a
    machine without a GPU, and, on one, the model of torch's order that torch's own function is checked against.
    ``exp``, ``log``: the elementwise functions (the interpreter's are numpy's)."""
    rows, vocabulary = logits.shape
    values = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        values.div_(torch.full((rows, 1), temperature, dtype=torch.float32, device=values.device))
    full = vocabulary // (ILP * BLOCK)
    body = values[:, : full * ILP * BLOCK].reshape(rows, full, BLOCK, ILP)
    top = values.amax(dim=-1).clamp_min(LOWEST)
    total = torch.zeros(rows, BLOCK, dtype=torch.float32, device=values.device)
    for k in range(full):
        for j in range(ILP):
            total = total + exp(body[:, k, :, j] - top[:, None])
    for start in range(full * ILP * BLOCK, vocabulary, BLOCK):
        part = values[:, start : start + BLOCK]
        total[:, : part.size(1)] = total[:, : part.size(1)] + exp(part - top[:, None])
    row_sum = _tree(_tree(total.reshape(rows, BLOCK // WARP, WARP)).reshape(rows, 1, BLOCK // WARP))[:, 0]
    chosen = values.gather(1, ids.reshape(-1, 1).to(torch.int64)).squeeze(1)
    return (chosen - top) - log(row_sum)


def _tree(lanes: torch.Tensor) -> torch.Tensor:
    """[..., 32] -> [...]: lane i + lane i + 16, then + 8 ... + 1 (a warp's shuffle-down sum, read at lane 0)."""
    width = lanes.size(-1)
    while width > 1:
        width //= 2
        lanes = lanes[..., :width] + lanes[..., width : 2 * width]
    return lanes[..., 0]
