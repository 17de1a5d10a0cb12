"""vLLM 0.31's top-p rule by call size, on its own kernel file run in Triton's interpreter (``kernel_copy``).

vLLM 0.31's ``apply_top_k_top_p_triton`` sends a CUDA call of at most ``_SPLIT_MAX_BATCH`` (64) rows with top-p and
no top-k through a split-row pipeline (each row split across programs by the call's size and the SM count; 132 SMs
here, an H100's) and a larger call through its monolithic kernel. The interpreted copy dispatches as on CUDA, so the
engine's small steps and the trainer's large chunks take different rules unless the plugin's engine wrapper sends
every step of top-p alone to the monolithic kernel, as the trainer does (``vllm_rule.apply_kernel``).

The rows: one token holds 99.5% of the mass and the top-p boundary falls in a tail of 299 tokens of nearly equal, tiny
probabilities (float32, and bf16-grid), where the two searches end on different cuts. The split pipeline is slow in
the interpreter (64 programs x 7 launches for 2 rows): the vocabulary is small and the calls few (module fixture).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trl_vlm_fixes.patches.sampling_parity import engine_sampler, kernel_copy, vllm_rule

VOCAB = 300
TOP_P = 0.9975
SPLIT_KERNELS = ("_topp_sb_stats_kernel", "_topp_sb_step_kernel", "_topp_sb_mask_kernel")
MONOLITHIC_KERNEL = "_topk_topp_kernel"


@pytest.fixture(scope="module")
def copy_0_31() -> dict[str, Any]:
    """The interpreted copy of vLLM 0.31's kernel file, with the CUDA tiles and dispatch."""
    pytest.importorskip("vllm")
    if (version := kernel_copy.proven_version()) != "0.31.0":
        installed = kernel_copy.why_no_copy() or f"the installed kernel file is vLLM {version}'s"
        pytest.skip(f"needs vLLM 0.31's kernel file: {installed}")
    return kernel_copy.copy_namespace(kernel_copy.CUDA_TILES)


def tail_rows() -> torch.Tensor:
    """[2, VOCAB]: token 0 at 0, the others around -11 (float32; the second row on the bf16 grid)."""
    generator = torch.Generator().manual_seed(0)
    rows = -11 + 0.3 * torch.randn(2, VOCAB, generator=generator)
    rows[:, 0] = 0.0
    rows[1] = rows[1].to(torch.bfloat16).float()
    return rows


def stand_in_step(rows: torch.Tensor, params: Any) -> list[tuple[int, float]]:
    """(kept tokens, token 0's processed log-prob) per request of one stand-in engine step over ``len(rows)``
    requests (vLLM's ``Sampler`` and ``InputBatch``; each reports token 0, always kept)."""
    from trl_vlm_fixes.selftest.vllm_sampler import Request, VllmSampler

    sampler = VllmSampler(vocab_size=rows.size(1), max_model_len=64)
    requests = [Request([1, 2, 3], params) for _ in rows]
    batch = sampler.new_batch(requests, tokenizer=None)
    sampled = batch.sample(
        {r.request_id: row.clone() for r, row in zip(requests, rows, strict=True)}, {r.request_id: 0 for r in requests}
    )
    return [(sampled[r.request_id].kept or 0, sampled[r.request_id].logprob) for r in requests]


def kept_and_logprob(masked: torch.Tensor) -> list[tuple[int, float]]:
    """(kept tokens, token 0's processed log-prob) per row, as vLLM's float32 log-softmax gives it."""
    logprobs = masked.log_softmax(-1, dtype=torch.float32)
    return [(int((row > -math.inf).sum()), float(row[0])) for row in logprobs]


@pytest.fixture
def launches(copy_0_31: dict[str, Any]) -> Iterator[list[tuple[str, int]]]:
    """(kernel, programs along the row: ``S`` for the split pipeline, 1 for the monolithic kernel) per launch."""
    seen: list[tuple[str, int]] = []
    hooks = []
    for name in (MONOLITHIC_KERNEL, *SPLIT_KERNELS):

        def hook(*args: Any, name: str = name, **kwargs: Any) -> None:
            seen.append((name, int(kwargs.get("S", 1))))

        copy_0_31[name].add_pre_run_hook(hook)
        hooks.append((copy_0_31[name], hook))
    yield seen
    for kernel, hook in hooks:
        kernel.pre_run_hooks.remove(hook)


@pytest.fixture(scope="module")
def vllms_own(copy_0_31: dict[str, Any]) -> SimpleNamespace:
    """vLLM's own ``apply_top_k_top_p_triton`` (interpreted, CUDA dispatch) on the rows as a call of 2 rows (an
    engine step) and inside a call of 65 (a trainer's chunk: 63 rows of p=1, which the kernel leaves as they are)."""
    kernel = kernel_copy.interpreted_top_k_top_p(kernel_copy.CUDA_TILES)
    rows = tail_rows()
    small = kernel(rows.clone(), None, torch.full((2,), TOP_P))
    padding = torch.randn(63, VOCAB, generator=torch.Generator().manual_seed(1))
    large = kernel(torch.cat([rows, padding]), None, torch.cat([torch.full((2,), TOP_P), torch.ones(63)]))
    assert torch.equal(large[2:], padding)  # p = 1: nothing cut there
    return SimpleNamespace(small=kept_and_logprob(small), large=kept_and_logprob(large[:2]))


def test_the_copy_sends_a_small_top_p_call_through_the_split_pipeline(
    copy_0_31: dict[str, Any], launches: list[tuple[str, int]]
) -> None:
    """The CUDA dispatch, modelled: a row of top-p alone takes the split pipeline (32 programs per row: 132 SMs),
    with a top-k the monolithic kernel (65 rows: ``vllms_own``)."""
    kernel = kernel_copy.interpreted_top_k_top_p(kernel_copy.CUDA_TILES)
    assert copy_0_31["_SPLIT_MAX_BATCH"] == 64
    rows = tail_rows()
    kernel(rows.clone(), torch.full((2,), 20, dtype=torch.int32), torch.full((2,), TOP_P))
    assert launches[0] == (MONOLITHIC_KERNEL, 1)  # an active top-k: the monolithic kernel at any size (the split
    # kernels launch after it for a p-only row and return at once for these)
    launches.clear()
    kernel(rows[:1].clone(), None, torch.full((1,), TOP_P))
    assert launches[0] == ("_topp_sb_stats_kernel", 32) and launches[-1] == ("_topp_sb_mask_kernel", 32)
    assert len(launches) == 2 + copy_0_31["_SPLIT_ROUNDS"] and MONOLITHIC_KERNEL not in dict(launches)


def test_engine_steps_and_trainer_chunks_take_different_top_p_rules_without_the_wrapper(
    vllms_own: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug, on vLLM 0.31's kernels: the same rows cut by a call of 2 (the split pipeline) and by one of 65 (the
    monolithic kernel) keep other sets (measured: 124 vs 128 and 123 vs 146 tokens; token 0's log-prob 7.2e-5 and
    4.1e-4 nats apart). Without the engine wrapper on vLLM's dispatch the fix steps aside on CPU tensors too, where
    the interpreted copy is the rule; with it, not; with a top-k, never."""
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_module

    small, large = vllms_own.small, vllms_own.large
    assert all(0 < kept < VOCAB for kept, _ in small + large)  # rows cut, not masked away
    assert [kept for kept, _ in small] != [kept for kept, _ in large]
    differences = [abs(a - b) for (_, a), (_, b) in zip(small, large, strict=True)]
    assert 1e-5 < max(differences) < 1e-3, differences
    cpu = torch.device("cpu")
    assert vllm_rule.size_dependent_top_p(0, TOP_P, cpu, VOCAB) is None  # the wrapper is on: one rule
    wrapped: Any = sampler_module.apply_top_k_top_p
    monkeypatch.setattr(sampler_module, "apply_top_k_top_p", wrapped.__wrapped__)
    reason = vllm_rule.size_dependent_top_p(0, TOP_P, cpu, VOCAB)
    assert reason is not None and "at most 64 requests" in reason and "engine wrapper is not on" in reason
    assert vllm_rule.size_dependent_top_p(20, TOP_P, cpu, VOCAB) is None


def test_the_wrapper_sends_a_small_top_p_step_to_the_monolithic_kernel_as_the_trainer_applies_it(
    vllms_own: SimpleNamespace, copy_0_31: dict[str, Any], launches: list[tuple[str, int]]
) -> None:
    """The fix: an engine step of 2 requests of a rollout the fix serves (the stand-in engine, vLLM 0.31's sampler
    and dispatch) takes the monolithic kernel, giving exactly what vLLM's own call of 65 rows gives, and so does the
    trainer's rule on any number of rows; the same step outside such a rollout (vLLM's dispatch as built) takes the
    split pipeline and keeps the other sets."""
    from vllm import SamplingParams

    rows, params = tail_rows(), SamplingParams(top_p=TOP_P)
    with engine_sampler.routed():
        routed = stand_in_step(rows, params)
    assert {name for name, _ in launches} == {MONOLITHIC_KERNEL}
    assert routed == vllms_own.large
    rule = kept_and_logprob(vllm_rule.top_k_top_p(rows.clone(), None, torch.full((2,), TOP_P)))
    assert rule == vllms_own.large
    launches.clear()
    unrouted = stand_in_step(rows, params)
    assert MONOLITHIC_KERNEL not in dict(launches) and "_topp_sb_mask_kernel" in dict(launches)
    assert unrouted == vllms_own.small and unrouted != routed
