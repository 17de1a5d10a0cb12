"""vLLM's top-k/top-p kernel over a trainer's chunk with one program per row, not vLLM's one per SM.

vLLM launches its monolithic top-k/top-p kernel with ``min(SMs, rows)`` programs, each sweeping its rows' vocabulary
serially in tiles (vLLM 0.31's own comment: "per-tile latency bounds kernel latency"). A colocated rank's engine
step (typically 16-64 requests) gets one program a row. A trainer's chunk holds hundreds of positions (270 at 248,320
tokens, 441 at 151,936), so on an H100 (132 SMs) vLLM's launch gives each program two to four rows in turn. The
cut's other stages (the float32 copy, vLLM's torch passes, the log-softmax) stay: ``min_p`` alone, which runs no
top-k/top-p kernel, cost 20-39% of the scoring pass on an H100 (docs/gpu-results.md section 13).

A row's result depends on its row alone: its program reads only that row, and its scratch row in the buffer
(``BUFFER + pid * VOCAB_SIZE``) only up to what it wrote for that row; the program count enters only the row loop's
stride. So the same compiled kernel (same tiles, warps and constexprs: the program count is not one) launched with
one program per row and a scratch buffer of that many rows keeps the same tokens bit for bit
(tests/test_wide_launch.py: the installed kernel file in Triton's interpreter, vLLM's launch at 2-3 rows a program
against one row a program, scratch rows full of NaN). Programs are capped at ``PROGRAMS_PER_UNIT`` per compute unit:
on an H100 or H200 every chunk at a vocabulary over 127,000 tokens gets one program a row. The scratch buffer (one
float32 row a program) is the call's own, at most the chunk's size, freed after it (vLLM's cached one, which the
colocated engine keeps between steps, holds one row per SM): the cut's peak memory grows by up to one chunk. Only the
kernel files whose launch was read for this (``kernel_copy.PROVEN``) are launched wide, and not a small call that
vLLM 0.31 finishes with its split-row pipeline (``launchable``); any other runs as vLLM launches it. On an H100,
vLLM 0.25.1's kernel on synthetic logits took 0.60-0.71x of vLLM's launch's time over the same chunks, every bit the
same (docs/gpu-results.md section 19, ``benchmarks/gpu/cut_launch.py``); 2 programs per SM gave nearly all of it, 8
no more than 4. vLLM 0.31's build (8 warps) was not timed.
"""

from __future__ import annotations

from typing import Any

import torch

from . import kernel_copy

# at most this many programs (one row each) per compute unit: 528 on an H100 or H200, more than a chunk's rows
# (``processed.CHUNK_ELEMENTS`` / vocabulary) at any vocabulary over 127,000 tokens
PROGRAMS_PER_UNIT = 4
# vLLM 0.25.1's tiles (``apply_top_k_top_p_triton``): a CPU tensor 256/128, any other 8192/4096 (XPU: not launched)
_TILES = {"cpu": (256, 128), "cuda": (8192, 4096)}


def programs_for(rows: int, compute_units: int) -> int:
    """Programs of a wide launch over ``rows`` rows: one per row, at most ``PROGRAMS_PER_UNIT`` per compute unit."""
    return max(1, min(rows, PROGRAMS_PER_UNIT * compute_units))


def launchable(scope: dict[str, Any], rows: int, k: torch.Tensor | None, p: torch.Tensor | None) -> bool:
    """Is a call of ``rows`` rows with these cuts launched wide on this kernel module? Its monolithic kernel must be
    launched in a way read for it (vLLM 0.25.1's ``_topk_topp_kernel[grid](...)``, or 0.31's ``_topk_topp(...,
    num_sm)`` dispatcher); and not a call where 0.31's ``apply_top_k_top_p_triton`` runs its split-row pipeline after
    the monolithic kernel (top-k and top-p in at most ``_SPLIT_MAX_BATCH`` rows: the split cuts top-p in the rows whose
    k is the vocabulary, which the monolithic kernel then skips). Such a call is small: vLLM's own function runs it."""
    if "_topk_topp" in scope:
        limit = kernel_copy.split_max_batch(scope)
        if k is not None and p is not None and limit is not None and rows <= limit:
            return False
        return kernel_copy.monolithic_problem(scope) is None
    return "_topk_topp_kernel" in scope and "_TRITON_TABLE_CACHE" in scope


def wide_top_k_top_p(
    scope: dict[str, Any], tiles: str, logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """vLLM's monolithic top-k/top-p kernel of ``scope`` (its module's globals: vLLM's on CUDA, the interpreted copy's
    on the CPU) on float32 ``logits`` [rows, vocabulary] in place, ``programs_for(rows, SMs)`` programs, with the tiles
    vLLM picks for ``tiles`` tensors. The same tokens as vLLM's launch of the same kernel (see the module's
    docstring)."""
    rows = kernel_copy.cut_rows(logits, k, p)
    if rows is None:
        return logits
    programs = programs_for(rows.size(0), int(scope["num_compute_units"](rows.device.index)))
    buffer = _scratch(rows, programs)
    if "_topk_topp" in scope:  # vLLM 0.31: its dispatcher launches min(num_sm, rows) programs
        kernel_copy.launch_topk_topp(scope, rows, buffer, k, p, programs)
        return rows
    normal_cdf_to_sigma, percentile_to_std = kernel_copy.kernel_tables(scope, rows)
    k_rows = None if k is None else k.to(torch.int32)
    p_rows = None if p is None else p.to(torch.float32)
    block, block_trunc = _TILES[tiles]
    scope["_topk_topp_kernel"][(programs,)](  # vLLM 0.25.1: apply_top_k_top_p_triton's launch, another grid
        rows,
        rows.stride(0),
        buffer,
        percentile_to_std,
        normal_cdf_to_sigma,
        rows if k_rows is None else k_rows,
        rows if p_rows is None else p_rows,
        BATCH_SIZE=rows.size(0),
        MASK_VALUE=float("-inf"),
        VOCAB_SIZE=rows.size(1),
        BLOCK_SIZE=block,
        BLOCK_SIZE_TRUNC=block_trunc,
        TOPK_ENABLED=k_rows is not None,
        TOPP_ENABLED=p_rows is not None,
    )
    return rows


def _scratch(logits: torch.Tensor, programs: int) -> torch.Tensor:
    """The launch's scratch rows, one per program (left as allocated: a row's program writes before it reads)."""
    return logits.new_empty((programs, logits.size(1)))
