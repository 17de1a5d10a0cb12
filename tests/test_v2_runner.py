"""vLLM's V2 model runner samples with kernels of its own (vLLM 0.25.1's default for models neither hybrid nor MoE,
0.29+'s for every family): its temperature, min-p and log-softmax kernels (``vllm/v1/worker/gpu/sample/``) run here
in Triton's interpreter, from vLLM's own source, and the trainer's processed log-prob (``processed.VllmSteps``) is
compared with what they return. The top-k/top-p step is the one every engine step takes (``vllm_rule.top_k_top_p``,
the name V2 binds being wrapped: tests/test_sampling_rule.py), the same function on both sides here.

Measured here (Triton's interpreter computes in numpy's IEEE float32): V2's temperature kernel is V1's division,
its log-softmax kernel V1's within float32's last bits; its min-p rule (logit < max + log(min_p)) is not V1's (prob <
min_p * max prob) at the boundary token: the trainer applies V2's rule where the colocated engine runs V2. On a GPU,
Triton may compile the division and ``tl.log``/``tl.exp`` to approximate instructions (an ulp or two): not measured.
V2's logit-bias and bad-words kernels are not run here: they set -inf or add a bias in float32 as V1's functions do,
and those commute with each other (read from vLLM's source).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trl_vlm_fixes.patches.sampling_parity import kernel_copy, vllm_rule
from trl_vlm_fixes.patches.sampling_parity.distribution import (
    LOGIT_MIN_P,
    PROBABILITY_MIN_P,
    SamplingDistribution,
)
from trl_vlm_fixes.patches.sampling_parity.processed import VllmSteps
from trl_vlm_fixes.selftest import v2_kernels

ROWS = 32  # a colocated rank's decode step (16-64 sequences)
VOCABULARY = 4096


@pytest.fixture(scope="module")
def v2() -> SimpleNamespace:
    """V2's kernels from vLLM's own source, in Triton's interpreter (``selftest/v2_kernels.py``)."""
    try:
        return v2_kernels.kernels(on_gpu=False)
    except v2_kernels.V2Unavailable as reason:
        pytest.skip(str(reason))


def _bf16_rows(seed: int) -> torch.Tensor:
    """A trained model's rows on the bf16 grid (ties common), ~2.5 nats of spread, as float32."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, VOCABULARY, generator=generator) * 2.5).to(torch.bfloat16).to(torch.float32)


def _v2_engine_step(
    v2: SimpleNamespace, logits: torch.Tensor, distribution: SamplingDistribution, seed: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """V2's ``Sampler.sample`` + ``compute_token_logprobs`` for one step: (sampled ids [rows, 1], their processed
    log-probs [rows], tokens the min-p kernel cut). The kernels run in Triton's interpreter."""
    rows = logits.size(0)
    mapping = torch.arange(rows, dtype=torch.int32)
    work = torch.empty_like(logits, dtype=torch.float32).copy_(logits)  # V2: "Copy logits to a new FP32 tensor"
    with kernel_copy.interpreting():
        if distribution.temperature not in (0.0, 1.0):  # SamplingStates.apply_temperature skips the kernel then
            v2.apply_temperature(work, mapping, torch.full((rows,), distribution.temperature))
        finite = int(torch.isfinite(work).sum())
        if distribution.min_p > 0.0:
            v2.apply_min_p(work, mapping, torch.full((rows,), distribution.min_p))
        cut_by_min_p = finite - int(torch.isfinite(work).sum())
    k = torch.full((rows,), distribution.top_k, dtype=torch.int32) if distribution.top_k else None
    p = torch.full((rows,), distribution.top_p) if distribution.top_p < 1.0 else None
    work = vllm_rule.top_k_top_p(work, k, p)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(torch.softmax(work, dim=-1), 1, generator=generator)
    with kernel_copy.interpreting():
        logprobs = v2.compute_token_logprobs(work, ids)
    return ids, logprobs.squeeze(1), cut_by_min_p


def _trainer(logits: torch.Tensor, ids: torch.Tensor, distribution: SamplingDistribution) -> torch.Tensor:
    steps = VllmSteps(distribution, logits.size(0), logits.size(1), logits.device)
    return steps.processed(logits.clone(), ids.squeeze(1)).processed


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 0.8, "min_p": 0.05},
        {"temperature": 1.0, "min_p": 0.1, "top_k": 50},
        {"temperature": 0.9, "min_p": 0.02, "top_p": 0.95},
    ],
    ids=lambda settings: ",".join(f"{name}={value}" for name, value in settings.items()),
)
def test_v2_runners_kernels_give_the_trainers_processed_log_prob(v2: SimpleNamespace, settings: dict[str, Any]) -> None:
    """Every row of a 32-request step, bf16-grid logits: the trainer's processed log-prob (V2's min-p rule where
    min_p is set) is the V2 kernels' within 1e-6 nats, so a 2,048-token completion's weight stays within 1e-3
    even if every token erred one way (measured: below 3e-7 per token)."""
    distribution = SamplingDistribution(**settings, min_p_rule=LOGIT_MIN_P)
    logits = _bf16_rows(1)
    ids, engine, cut_by_min_p = _v2_engine_step(v2, logits, distribution, seed=2)
    trainer = _trainer(logits, ids, distribution)
    assert engine.shape == trainer.shape == (ROWS,) and torch.isfinite(engine).all()  # no row masked away
    if distribution.min_p > 0.0:
        assert cut_by_min_p > ROWS  # the min-p kernel ran and cut
    assert (engine - trainer).abs().max().item() < 1e-6


def test_v2_runners_min_p_rule_is_not_v1s_at_the_boundary_token(v2: SimpleNamespace) -> None:
    """At the boundary token the trainer that applied V1's min-p to a V2 engine's step is off by the token's share
    (the bug), and exact with V2's rule (the fix): every row sampled token 1's neighbours, token 1 itself decides."""
    min_p, temperature = 0.05, 0.8
    logits = v2_kernels.min_p_boundary_rows(ROWS, VOCABULARY, min_p, temperature)
    assert len(logits) == ROWS, f"only {len(logits)} rows where V1's and V2's min-p rules disagree were found"
    fixed = SamplingDistribution(temperature=temperature, min_p=min_p, min_p_rule=LOGIT_MIN_P)
    ids = torch.zeros(ROWS, 1, dtype=torch.long)  # token 0 (the largest) is kept under both rules: it shows the cut
    mapping = torch.arange(ROWS, dtype=torch.int32)
    work = logits.clone()
    with kernel_copy.interpreting():
        v2.apply_temperature(work, mapping, torch.full((ROWS,), temperature))
        v2.apply_min_p(work, mapping, torch.full((ROWS,), min_p))
        engine = v2.compute_token_logprobs(work, ids).squeeze(1)
    v1_rule = _trainer(logits, ids, SamplingDistribution(temperature=temperature, min_p=min_p))
    v2_rule = _trainer(logits, ids, fixed)
    assert (engine - v1_rule).abs().max().item() > 1e-4  # the bug: V1's rule on a V2 engine's step
    assert (engine - v2_rule).abs().max().item() < 1e-6  # the fix


def test_the_colocated_engines_runner_picks_the_min_p_rule(caplog: pytest.LogCaptureFixture) -> None:
    """The colocated engine's runner is read from its config (V2: the logit rule, said once at INFO); a server's
    cannot be read: V1's rule, and one WARNING saying how to make it exact; no min_p: nothing to choose."""
    from trl_vlm_fixes.patches import sampling_parity

    def generation(mode: str, v2_runner: bool, min_p: float) -> Any:
        config = SimpleNamespace(use_v2_model_runner=v2_runner)
        return SimpleNamespace(
            mode=mode,
            temperature=1.0,
            min_p=min_p,
            top_p=1.0,
            top_k=0,
            repetition_penalty=1.0,
            generation_kwargs={},
            llm=SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config)),
        )

    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        assert sampling_parity._asked_for(generation("colocate", False, 0.05)).min_p_rule == PROBABILITY_MIN_P
        assert not caplog.records
        assert sampling_parity._asked_for(generation("colocate", True, 0.0)).min_p_rule == PROBABILITY_MIN_P
        assert not caplog.records  # no min_p: no rule to choose, nothing said
        assert sampling_parity._asked_for(generation("colocate", True, 0.05)).min_p_rule == LOGIT_MIN_P
        assert [r.levelno for r in caplog.records] == [logging.INFO] and "V2" in caplog.records[0].getMessage()
        caplog.clear()
        assert sampling_parity._asked_for(generation("server", True, 0.05)).min_p_rule == PROBABILITY_MIN_P
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in caplog.records[0].getMessage()
