"""vLLM's V2 model runner samples with kernels of its own (vLLM 0.25.1's default for models neither hybrid nor MoE,
0.29+'s for every family): its temperature, min-p and log-softmax kernels (``vllm/v1/worker/gpu/sample/``) run here
in Triton's interpreter, from vLLM's own source, and the trainer's processed log-prob (``processed.VllmSteps``) is
compared with what they return. The top-k/top-p step is the one every engine step takes (``vllm_rule.top_k_top_p``,
the name V2 binds being wrapped: tests/test_sampling_rule.py), the same function on both sides here.

Measured here (Triton's interpreter computes in numpy's IEEE float32): V2's temperature kernel is V1's division,
its log-softmax kernel V1's within float32's last bits; its min-p rule (logit < max + log(min_p)) is not V1's (prob <
min_p * max prob) at the boundary token: the trainer applies V2's rule where the colocated engine runs V2. On an H100
(docs/gpu-results.md section 14) the compiled temperature kernel is not IEEE division but a multiplication by the
reciprocal, which moves the approximate top-p cut: the trainer runs the engine's kernel where the engine runs V2
(``engine_steps.py``), shown here with that arithmetic standing in for the compiled kernel.
V2's logit-bias and bad-words kernels are not run here: they set -inf or add a bias in float32 as V1's functions do,
and those commute with each other (read from vLLM's source).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trl_vlm_fixes.patches.sampling_parity import engine_steps, kernel_copy
from trl_vlm_fixes.patches.sampling_parity.distribution import V1_RUNNER, V2_RUNNER, SamplingDistribution
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


@pytest.fixture(scope="module")
def engine(v2: SimpleNamespace) -> v2_kernels.Engine:
    """V2's step with its kernels interpreted (``v2_kernels.Engine``)."""
    return v2_kernels.Engine(torch.device("cpu"))


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
def test_v2_runners_kernels_give_the_trainers_processed_log_prob(
    engine: v2_kernels.Engine, settings: dict[str, Any]
) -> None:
    """Every row of a 32-request step, bf16-grid logits: the trainer's processed log-prob (V2's steps where the
    engine runs V2) is the V2 kernels' within 1e-6 nats, so a 2,048-token completion's weight stays within 1e-3
    even if every token erred one way (measured: below 3e-7 per token)."""
    distribution = SamplingDistribution(**settings, runner=V2_RUNNER)
    logits = _bf16_rows(1)
    ids, engine_logps, cut_by_min_p = engine.step(logits, distribution, seed=2)
    trainer = _trainer(logits, ids, distribution)
    assert engine_logps.shape == trainer.shape == (ROWS,) and torch.isfinite(engine_logps).all()  # no row masked
    if distribution.min_p > 0.0:
        assert cut_by_min_p > ROWS  # the min-p kernel ran and cut
    assert (engine_logps - trainer).abs().max().item() < 1e-6


def test_v2_runners_min_p_rule_is_not_v1s_at_the_boundary_token(engine: v2_kernels.Engine) -> None:
    """At the boundary token the trainer that applied V1's min-p to a V2 engine's step is off by the token's share
    (the bug), and exact with V2's rule (the fix): every row sampled token 1's neighbours, token 1 itself decides."""
    min_p, temperature = 0.05, 0.8
    logits = v2_kernels.min_p_boundary_rows(ROWS, VOCABULARY, min_p, temperature)
    assert len(logits) == ROWS, f"only {len(logits)} rows where V1's and V2's min-p rules disagree were found"
    fixed = SamplingDistribution(temperature=temperature, min_p=min_p, runner=V2_RUNNER)
    ids = torch.zeros(ROWS, 1, dtype=torch.long)  # token 0 (the largest) is kept under both rules: it shows the cut
    work = engine.temperature(logits, temperature)
    assert engine.min_p(work, min_p) > 0  # the kernel ran and cut
    engine_logps = engine.logprobs(work, ids)
    v1_rule = _trainer(logits, ids, SamplingDistribution(temperature=temperature, min_p=min_p))
    v2_rule = _trainer(logits, ids, fixed)
    assert (engine_logps - v1_rule).abs().max().item() > 1e-4  # the bug: V1's rule on a V2 engine's step
    assert (engine_logps - v2_rule).abs().max().item() < 1e-6  # the fix


def _reciprocal_temperature(logits: torch.Tensor, mapping: torch.Tensor, temperatures: torch.Tensor) -> None:
    """What V2's temperature kernel computes compiled for an H100 (docs/gpu-results.md section 14): the logits times
    the float32 reciprocal, not IEEE division (the interpreter's). Skips temperature 1, as the kernel does."""
    scale = torch.where(temperatures == 1.0, 1.0, 1.0 / temperatures)
    logits.mul_(scale[mapping.long()].unsqueeze(1))


def test_the_trainer_runs_the_engines_temperature_kernel(v2: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A V2 engine whose temperature kernel is not IEEE division (compiled on CUDA) moves the approximate top-p cut;
    a trainer that divides by the temperature (V1's step: the bug) is then off by a token's share in some rows of a
    32-request step, and the trainer that runs the engine's kernel (where the engine runs V2 and the logits are on a
    GPU: here the kernel's measured arithmetic stands in for it) is exact. The GPU record runs vLLM's compiled kernel
    on both sides (benchmarks/gpu/v2_sampler_kernels.py)."""
    if reason := kernel_copy.why_no_copy():  # vLLM's sort path cuts top-p by sorted position: the bits move nothing
        pytest.skip(f"the approximate top-p cut is vLLM's Triton kernel's, interpreted on 0.25.1's, 0.31's: {reason}")
    stand_in = v2_kernels.Engine(torch.device("cpu"), temperature_kernel=_reciprocal_temperature)
    settings = {"temperature": 0.9, "top_p": 0.95}
    logits = _bf16_rows(1)
    ids, engine_logps, _ = stand_in.step(logits, SamplingDistribution(**settings, runner=V2_RUNNER), seed=2)
    assert torch.isfinite(engine_logps).all()
    divided = _trainer(logits, ids, SamplingDistribution(**settings, runner=V1_RUNNER))
    assert ((engine_logps - divided).abs() > 1e-4).sum() >= 2  # the bug: rows whose cut moved
    called: list[int] = []

    def kernel(logits: torch.Tensor, mapping: torch.Tensor, temperatures: torch.Tensor) -> None:
        called.append(logits.size(0))
        _reciprocal_temperature(logits, mapping, temperatures)

    monkeypatch.setattr(engine_steps, "v2_kernel", lambda: kernel)
    monkeypatch.setattr(engine_steps, "v2_min_p_kernel", lambda: None)
    monkeypatch.setattr(engine_steps, "uses_v2_kernel", lambda runner, device: runner == V2_RUNNER)
    fixed = _trainer(logits, ids, SamplingDistribution(**settings, runner=V2_RUNNER))
    assert ROWS in called  # the trainer's step ran the engine's kernel on its rows
    assert (engine_logps - fixed).abs().max().item() < 1e-6  # the fix
    assert _trainer(logits, ids, SamplingDistribution(**settings, runner=V1_RUNNER)).equal(divided)  # V1: division


def test_the_colocated_engines_runner_is_read(caplog: pytest.LogCaptureFixture) -> None:
    """The colocated engine's runner is read from its config (V2: its steps, said once at INFO where they change the
    trainer's arithmetic: min_p, a temperature other than 1). A server's cannot be read: V1's steps, and one WARNING
    saying how to make it exact, where a V2 server would move a cut (min_p; top_p at a temperature other than 1) and
    the model is not one that vLLM before 0.29 serves with V1 (hybrid or MoE)."""
    from trl_vlm_fixes.patches import sampling_parity

    def generation(
        mode: str, v2_runner: bool, min_p: float, temperature: float = 1.0, top_p: float = 1.0, model: Any = None
    ) -> Any:
        config = SimpleNamespace(use_v2_model_runner=v2_runner)
        return SimpleNamespace(
            mode=mode,
            temperature=temperature,
            min_p=min_p,
            top_p=top_p,
            top_k=0,
            repetition_penalty=1.0,
            generation_kwargs={},
            llm=SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=config)),
            model=model,
        )

    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        assert sampling_parity._asked_for(generation("colocate", False, 0.05)).runner == V1_RUNNER
        assert sampling_parity._asked_for(generation("colocate", True, 0.0)).runner == V2_RUNNER
        assert not caplog.records  # V1, or V2 at temperature 1 without min_p: the same arithmetic, nothing said
        assert sampling_parity._asked_for(generation("colocate", True, 0.0, temperature=0.7)).runner == V2_RUNNER
        assert sampling_parity._asked_for(generation("colocate", True, 0.05)).runner == V2_RUNNER
        assert [r.levelno for r in caplog.records] == [logging.INFO] and "V2" in caplog.records[0].getMessage()
        caplog.clear()
        if _installed_vllm_before_0_29():  # a hybrid model: V1 on such a server, nothing to warn of
            qwen35 = SimpleNamespace(config=_config({"text_config": {"layer_types": ["linear_attention"]}}))
            assert sampling_parity._asked_for(generation("server", True, 0.05, model=qwen35)).runner == V1_RUNNER
            assert not caplog.records
        # a server that may run V2: even with nothing cut its log-softmax rounds otherwise than V1's, said once
        assert sampling_parity._asked_for(generation("server", True, 0.0, temperature=0.7)).runner == V1_RUNNER
        assert sampling_parity._asked_for(generation("server", True, 0.05)).runner == V1_RUNNER
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in caplog.records[0].getMessage()
    assert "log-softmax" in caplog.records[0].getMessage()


def _installed_vllm_before_0_29() -> bool:
    from importlib.metadata import version

    return tuple(int(part) for part in version("vllm").split(".")[:2]) < (0, 29)


def _config(values: dict[str, Any]) -> Any:
    """A model config as transformers' (``to_dict``), its text config an attribute."""
    text = SimpleNamespace(**values.get("text_config", {}))
    return SimpleNamespace(to_dict=lambda: values, text_config=text)


def test_the_trainers_v2_steps_run_vllms_own_kernels(v2: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's V2 steps (``engine_steps``) called with vLLM's own V2 kernels, as on CUDA (here interpreted): the
    arguments fit them (every row changed where it must be), and in IEEE float32 they give V1's division and V2's
    rule in torch bit for bit, so the CPU path the trainer takes without them is the same arithmetic."""
    from trl_vlm_fixes.patches.sampling_parity import kernel_copy

    calls: list[str] = []

    def interpreted(name: str, kernel: Any) -> Any:
        def run(logits: torch.Tensor, mapping: torch.Tensor, values: torch.Tensor) -> None:
            calls.append(name)
            with kernel_copy.interpreting():
                kernel(logits, mapping, values)

        return run

    logits = v2_kernels.min_p_boundary_rows(8, VOCABULARY, 0.05, 0.8)
    divided = engine_steps.apply_scalar(logits.clone(), 0.8, V1_RUNNER)
    by_rule = engine_steps.logit_min_p(divided.clone(), 0.05, V1_RUNNER)
    monkeypatch.setattr(engine_steps, "v2_kernel", lambda: interpreted("temperature", v2.apply_temperature))
    monkeypatch.setattr(engine_steps, "v2_min_p_kernel", lambda: interpreted("min_p", v2.apply_min_p))
    monkeypatch.setattr(engine_steps, "uses_v2_kernel", lambda runner, device: runner == V2_RUNNER)
    scaled = engine_steps.apply_scalar(logits.clone(), 0.8, V2_RUNNER)
    cut = engine_steps.logit_min_p(scaled.clone(), 0.05, V2_RUNNER)
    assert calls == ["temperature", "min_p"]  # vLLM's kernels ran, on every row
    assert not scaled.equal(logits) and torch.isinf(cut).any(dim=1).all()  # each row scaled, each row cut
    assert scaled.equal(divided) and cut.equal(by_rule)


def test_the_trainers_plain_log_prob_on_a_v2_engine_is_v2s_own_log_softmax(
    v2: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V2 reports the log-softmax of its own kernel (block sums of Triton's ``exp``), V1 torch's ``log_softmax``, whose
    float32 sum rounds one way beside the largest terms: over a completion of a trained spread's tokens the two differ
    by more than 1e-4 of the weight (the bug: V1's function against a V2 engine; on an H100 up to 5.9e-4 at 2,048
    tokens, docs/gpu-results.md section 17). Where the engine runs V2 the trainer's plain log-prob is V2's kernel's,
    bit for bit (here interpreted, as on CUDA compiled); where it runs V1, torch's."""
    from trl_vlm_fixes.patches.sampling_parity import processed

    generator = torch.Generator().manual_seed(3)
    positions = 1024
    logits = (torch.randn(positions, VOCABULARY, generator=generator) * 4.5).to(torch.bfloat16)  # ~2.5 nats
    ids = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator).squeeze(1)
    engine = v2_kernels.Engine(torch.device("cpu")).logprobs(logits.float(), ids.unsqueeze(1))
    v1_function = torch.log_softmax(logits.float(), dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    assert torch.isfinite(engine).all() and engine.shape == (positions,)
    assert abs(float((v1_function.double() - engine.double()).sum())) > 1e-4  # the bug, summed over the completion

    called: list[int] = []

    def kernel(values: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        called.append(values.size(0))
        with kernel_copy.interpreting():
            return v2.compute_token_logprobs(values, token_ids)

    monkeypatch.setattr(engine_steps, "v2_log_prob_kernel", lambda: kernel)
    monkeypatch.setattr(engine_steps, "uses_v2_kernel", lambda runner, device: runner == V2_RUNNER)
    scored = processed.Positions(torch.zeros(positions, 1), None, logits)  # TRL 1.9.1's bf16 logits, read
    fixed = scored.plain_log_probs(1.0, ids, V2_RUNNER)
    assert sum(called) == positions  # V2's kernel ran on every position
    assert torch.equal(fixed, engine)
    assert torch.equal(scored.plain_log_probs(1.0, ids, V1_RUNNER), v1_function)  # V1's engine: torch's
