"""The trainer's top-k/top-p over a chunk with one program per row (``wide_launch``) keeps the tokens vLLM's launch of
the same kernel keeps, bit for bit, on the installed vLLM's kernel file in Triton's interpreter (0.25.1 on the
validated stack, 0.31 on the newest).

vLLM launches ``min(SMs, rows)`` programs; a program with several rows takes them in turn and reuses its scratch row.
Here the copy is given 5 compute units, so vLLM's launch over 12 rows gives programs 2-3 rows each, while the wide
launch gives each row its own program and a scratch buffer filled with NaN: any dependence of a row's result on the
program count, the row order within a program or the scratch row's earlier contents would show. The rows have several
tiles (the CUDA tiles, 8,192 tokens), bf16-grid ties and a realistic spread; each setting must cut in every row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trl_vlm_fixes.patches.sampling_parity import kernel_copy, monolithic, vllm_rule, wide_launch

VOCAB = 20_000  # three CUDA tiles
ROWS = 12
UNITS = 5  # vLLM's launch: min(5, 12) programs, 2-3 rows each
SMALL_CALL = 4  # vLLM 0.31's split-row pipeline: calls of at most this many rows here (64 in vLLM)
SETTINGS = {"top_k": (20, None), "top_p": (None, 0.9975), "top_k and top_p": (50, 0.8)}


@pytest.fixture(scope="module")
def copy_scope() -> dict[str, Any]:
    pytest.importorskip("vllm")
    if (reason := kernel_copy.why_no_copy()) is not None:
        pytest.skip(f"no interpreted kernel copy: {reason}")
    return kernel_copy.copy_namespace(kernel_copy.CUDA_TILES)


@pytest.fixture
def five_units(copy_scope: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The copy as on a GPU of 5 compute units; yields the program count of each wide launch (its scratch rows),
    whose scratch buffer is NaN."""
    monkeypatch.setitem(copy_scope, "num_compute_units", lambda device_id=None: UNITS)
    monkeypatch.setitem(copy_scope, "_TRITON_BUFFER_CACHE", {})  # vLLM's own launch: its cached scratch rows, NaN too
    if kernel_copy.split_max_batch(copy_scope) is not None:  # 0.31: 12 rows a large call, as a trainer's chunk is
        monkeypatch.setitem(copy_scope, "_SPLIT_MAX_BATCH", SMALL_CALL)
    programs: list[int] = []

    def nan_scratch(logits: torch.Tensor, count: int) -> torch.Tensor:
        programs.append(count)
        return torch.full((count, logits.size(1)), math.nan)

    monkeypatch.setattr(wide_launch, "_scratch", nan_scratch)
    yield programs


def rows_with_ties() -> torch.Tensor:
    """[ROWS, VOCAB] float32 on the bf16 grid (ties are common there): half with a trained model's spread, half with
    one dominant token, 39 likely ones and a long flat tail where a top-p of 0.9975 ends (there vLLM's approximate
    search ends by its tiles: with the CPU tiles it keeps ~400 more tokens a row)."""
    generator = torch.Generator().manual_seed(7)
    spread = 3.0 * torch.randn(ROWS // 2, VOCAB, generator=generator)
    tail = -11 + 0.3 * torch.randn(ROWS - ROWS // 2, VOCAB, generator=generator)
    tail[:, 0] = 0.0
    tail[:, 1:40] = -4 + 0.5 * torch.randn(len(tail), 39, generator=generator)
    return torch.cat([spread, tail]).to(torch.bfloat16).float()


def vllms_launch(copy_scope: dict[str, Any], logits: torch.Tensor, k: Any, p: Any) -> torch.Tensor:
    """The engine's rule as vLLM launches it (``monolithic.apply_kernel``: 0.31's top-p alone to its monolithic
    kernel), with vLLM's own scratch buffer (NaN-filled) and program count."""
    kernel = kernel_copy.interpreted_top_k_top_p(kernel_copy.CUDA_TILES)
    buffers = copy_scope["_TRITON_BUFFER_CACHE"]
    buffers[(logits.device, logits.dtype, VOCAB)] = torch.full((UNITS, VOCAB), math.nan)
    return monolithic.apply_kernel(kernel, logits, k, p)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_one_program_per_row_keeps_vllms_tokens_bit_for_bit(
    setting: str, copy_scope: dict[str, Any], five_units: list[int]
) -> None:
    top_k, top_p = SETTINGS[setting]
    logits = rows_with_ties()
    k = None if top_k is None else torch.full((ROWS,), top_k, dtype=torch.int32)
    p = None if top_p is None else torch.full((ROWS,), top_p, dtype=torch.float32)
    launched: list[int] = []
    kernel = copy_scope["_topk_topp_kernel"]
    original_getitem = type(kernel).__getitem__

    def counting(self: Any, grid: Any) -> Any:  # the monolithic kernel's launches (0.31 also launches its split ones)
        if self is kernel:
            launched.append(grid[0] if isinstance(grid, tuple) else -1)
        return original_getitem(self, grid)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(kernel), "__getitem__", counting)
        expected = vllms_launch(copy_scope, logits.clone(), k, p)
        narrow = list(launched)
        ours = vllm_rule.top_k_top_p(logits.clone(), k, p)
    kept = (ours > -math.inf).sum(-1)
    assert bool(((kept > 0) & (kept < VOCAB)).all()), f"{setting} must cut in every row: kept {kept.tolist()}"
    if top_k is not None:
        assert bool((kept <= top_k).all()), kept.tolist()
    assert five_units == [ROWS], "the trainer's rule took the wide launch, one program per row"
    assert narrow[-1:] == [UNITS], f"vLLM's launch ran {narrow} programs (2-3 rows each), not one per row"
    assert launched[len(narrow) :] == [ROWS], launched
    assert torch.equal(ours, expected), (
        f"{setting}: rows whose kept tokens differ: "
        f"{[row for row in range(ROWS) if not torch.equal(ours[row], expected[row])]}"
    )


def test_a_small_call_with_top_k_and_top_p_is_vllms_own(copy_scope: dict[str, Any], five_units: list[int]) -> None:
    """vLLM 0.31 cuts a small call with top-k and top-p in two launches: its monolithic kernel skips top-p in the rows
    whose k is the vocabulary, and its split-row pipeline cuts them. Such a call is not launched wide there (it would
    leave those rows uncut); on 0.25.1, whose kernel has no split, it is. Either way vLLM's function's tokens."""
    rows = SMALL_CALL
    logits = rows_with_ties()[-rows:]  # the tail rows: where top-p's boundary falls in the flat tail
    k = torch.tensor([VOCAB, 50] * (rows // 2), dtype=torch.int32)
    p = torch.full((rows,), 0.9975, dtype=torch.float32)
    expected = kernel_copy.interpreted_top_k_top_p(kernel_copy.CUDA_TILES)(logits.clone(), k, p)
    ours = vllm_rule.top_k_top_p(logits.clone(), k, p)
    kept = (ours > -math.inf).sum(-1)
    assert bool((kept < VOCAB).all()), f"every row cut, the rows whose k is the vocabulary by top-p: {kept.tolist()}"
    splits = kernel_copy.split_max_batch(copy_scope) is not None
    assert five_units == ([] if splits else [rows]), five_units
    assert torch.equal(ours, expected)


def test_programs_are_one_per_row_up_to_the_cap() -> None:
    assert wide_launch.programs_for(270, 132) == 270
    cap = wide_launch.PROGRAMS_PER_UNIT * 132
    assert wide_launch.programs_for(10 * cap, 132) == cap
    assert wide_launch.programs_for(3, 132) == 3


def test_a_kernel_module_not_read_for_it_is_launched_as_vllm_launches_it() -> None:
    assert not wide_launch.launchable({"apply_top_k_top_p_triton": object()}, 270, None, torch.ones(270))
