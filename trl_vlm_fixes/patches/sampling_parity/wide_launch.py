"""vLLM's top-k/top-p kernel over a trainer's chunk with one program per row, not vLLM's one per SM.

vLLM launches its monolithic top-k/top-p kernel with ``min(SMs, rows)`` programs, each sweeping its rows' vocabulary
serially in tiles; vLLM 0.31's own comment: "per-tile latency bounds kernel latency". An engine step holds at most a
few dozen rows, one program each. A trainer's chunk holds hundreds of positions (270 at 248,320 tokens, 441 at
151,936), so vLLM's launch on an H100 (132 SMs) gives each program two to four rows in turn: the cuts cost 20-64% of
the scoring pass there (docs/gpu-results.md, sections 13 and 15), the kernel most of it.

A row's result depends on its row alone: its program reads only that row, and its scratch row in the buffer
(``BUFFER + pid * VOCAB_SIZE``) only up to what it wrote for that row; the program count enters only the row loop's
stride. So the same compiled kernel (same tiles, warps and constexprs: the program count is not one) launched with
one program per row and a scratch buffer of that many rows keeps the same tokens bit for bit
(tests/test_wide_launch.py: the installed kernel file in Triton's interpreter, vLLM's launch at 2-3 rows a program
against one row a program, scratch rows full of NaN). Programs are capped at ``PROGRAMS_PER_UNIT`` per compute unit,
which at a real vocabulary (over 127,000 tokens) leaves every chunk one program per row, and bounds the scratch buffer
(one float32 row a program) by the chunk's own size. The buffer is the call's own, not vLLM's cached one, which the
colocated engine keeps between steps. Only the kernel files whose launch was read for this (``kernel_copy.PROVEN``)
are launched wide; any other runs as vLLM launches it. Not yet timed on a GPU (``benchmarks/gpu/cut_launch.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# at most this many programs (one row each) per compute unit: 528 on an H100, more than a chunk's rows at any
# vocabulary over 127,000 tokens (``processed.CHUNK_ELEMENTS`` / vocabulary)
PROGRAMS_PER_UNIT = 4
# vLLM 0.25.1's tiles (``apply_top_k_top_p_triton``): a CPU tensor 256/128, any other 8192/4096 (XPU: not launched)
_TILES = {"cpu": (256, 128), "cuda": (8192, 4096)}


def programs_for(rows: int, compute_units: int) -> int:
    """Programs of a wide launch over ``rows`` rows: one per row, at most ``PROGRAMS_PER_UNIT`` per compute unit."""
    return max(1, min(rows, PROGRAMS_PER_UNIT * compute_units))


def launchable(scope: dict[str, Any]) -> bool:
    """Does this kernel module launch its monolithic kernel in a way read for a wide launch (vLLM 0.25.1's
    ``_topk_topp_kernel[grid](...)``, or 0.31's ``_topk_topp(..., num_sm)`` dispatcher)?"""
    from . import kernel_copy

    if "_topk_topp" in scope:
        return kernel_copy.monolithic_problem(scope) is None
    return "_topk_topp_kernel" in scope and "_TRITON_TABLE_CACHE" in scope


def wide_top_k_top_p(
    scope: dict[str, Any], tiles: str, logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """vLLM's monolithic top-k/top-p kernel of ``scope`` (its module's globals: vLLM's on CUDA, the interpreted copy's
    on the CPU) on float32 ``logits`` [rows, vocabulary] in place, ``programs_for(rows, SMs)`` programs, with the tiles
    vLLM picks for ``tiles`` tensors. The same tokens as vLLM's launch of the same kernel (see the module's
    docstring)."""
    assert logits.ndim == 2 and logits.dtype == torch.float32
    rows, vocabulary = logits.shape
    if rows == 0 or (k is None and p is None):
        return logits
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    programs = programs_for(rows, int(scope["num_compute_units"](logits.device.index)))
    buffer = _scratch(logits, programs)
    normal_cdf_to_sigma, percentile_to_std = _tables(scope, logits)
    k_rows = None if k is None else k.to(torch.int32)
    p_rows = None if p is None else p.to(torch.float32)
    if "_topk_topp" in scope:  # vLLM 0.31: its dispatcher launches min(num_sm, rows) programs
        scope["_topk_topp"](
            logits, buffer, percentile_to_std, normal_cdf_to_sigma, k_rows, p_rows, float("-inf"), programs
        )
        return logits
    block, block_trunc = _TILES[tiles]
    scope["_topk_topp_kernel"][(programs,)](  # vLLM 0.25.1: apply_top_k_top_p_triton's launch, another grid
        logits,
        logits.stride(0),
        buffer,
        percentile_to_std,
        normal_cdf_to_sigma,
        logits if k_rows is None else k_rows,
        logits if p_rows is None else p_rows,
        BATCH_SIZE=rows,
        MASK_VALUE=float("-inf"),
        VOCAB_SIZE=vocabulary,
        BLOCK_SIZE=block,
        BLOCK_SIZE_TRUNC=block_trunc,
        TOPK_ENABLED=k_rows is not None,
        TOPP_ENABLED=p_rows is not None,
    )
    return logits


def _scratch(logits: torch.Tensor, programs: int) -> torch.Tensor:
    """The launch's scratch rows, one per program (left as allocated: a row's program writes before it reads)."""
    return logits.new_empty((programs, logits.size(1)))


def _tables(scope: dict[str, Any], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's lookup tables on the logits' device, from (and into) its module's cache, as its launch makes them."""
    cache = scope["_TRITON_TABLE_CACHE"]
    tables = cache.get(logits.device)
    if tables is None:
        allowed = scope.get("gpu_sync_allowed", contextlib.nullcontext)  # vLLM 0.31's sync-debug switch
        with allowed():
            tables = (
                logits.new_tensor(scope["_NORMAL_CDF_TO_SIGMA_TABLE"]),
                logits.new_tensor(scope["_PERCENTILE_TO_STD_TABLE"]),
            )
        cache[logits.device] = tables
    return tables  # type: ignore[no-any-return]
