"""sampling_parity, float32 on every path: TRL 1.9.1 log-softmaxes a bf16 model's bf16 logits in bf16 (after dividing
them by the temperature in place, in bf16), vLLM upcasts the same logits to float32 first. With identical logits on
both sides and nothing cut, TRL's importance-sampling weight is then bf16 rounding, not the engine/trainer mismatch;
with the fix the trainer's log-prob is float32 arithmetic on the model's logits on every path (nothing cut, the ban
alone, truncation), and the weight is 1."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trl_vlm_fixes.patches.sampling_parity import processed
from trl_vlm_fixes.patches.sampling_parity.distribution import SamplingDistribution, read_distribution

VOCABULARY = 4096
SCALE = 4.5  # logits of std 4.5 over 4,096 tokens: ~2.5 nats of entropy, a trained model's spread
BANNED = (7, 11, 13)  # placeholder-like ids the plugin's default ban (vision_token_guard) removes


def bf16_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """A bf16 model's logits: bf16 tensors."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCABULARY, generator=generator) * SCALE).to(torch.bfloat16)


def trls_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """TRL 1.9.1's scoring pass on these logits, with TRL's own function: ``logits.div_(temperature)`` in the logits'
    dtype, then ``selective_log_softmax`` (its bf16 branch: a log-softmax in bf16)."""
    from trl.trainer.utils import selective_log_softmax

    scaled = logits.clone()[None]
    scaled.div_(temperature)
    return selective_log_softmax(scaled, ids[None])[0]


def vllm_log_probs(logits: torch.Tensor, settings: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled ids, processed log-probs) of vLLM 0.25.1's real Sampler on the same bf16 logits, one request per row
    (the Sampler upcasts them to float32 itself)."""
    from vllm import SamplingParams

    from trl_vlm_fixes.selftest.vllm_sampler import Request, VllmSampler

    sampler = VllmSampler(vocab_size=VOCABULARY, max_model_len=64)
    params = SamplingParams(logprobs=0, seed=0, **settings)
    ids, logprobs = [], []
    for step in logits.split(256):  # engine steps of at most 256 requests (the stand-in's batch)
        requests = [Request([1, 2, 3], params) for _ in range(step.size(0))]
        batch = sampler.new_batch(requests, tokenizer=None)
        sampled = batch.sample({r.request_id: row for r, row in zip(requests, step, strict=True)}, {})
        ids += [sampled[r.request_id].token_id for r in requests]
        logprobs += [sampled[r.request_id].logprob for r in requests]
    return torch.tensor(ids), torch.tensor(logprobs)


def sequence_weight(trainer: torch.Tensor, engine: torch.Tensor) -> float:
    """TRL's importance-sampling weight of one completion made of these tokens (``sequence`` level)."""
    return math.exp(float((trainer.double() - engine.double()).sum()))


# (name, vLLM's settings, the number of positions): the plain distribution and the plugin's ban over a 2,048-token
# completion, at TRL's default temperature and at 0.7; truncation on fewer positions (each one runs vLLM's Triton
# top-k/top-p kernel in the interpreter on the CPU, as every engine step does with the fix)
CASES = [
    ("nothing cut", {"temperature": 1.0}, 2048),
    ("nothing cut, temperature 0.7", {"temperature": 0.7}, 2048),
    ("ban", {"temperature": 1.0, "logit_bias": dict.fromkeys(BANNED, -math.inf)}, 2048),
    ("ban, temperature 0.7", {"temperature": 0.7, "logit_bias": dict.fromkeys(BANNED, -math.inf)}, 2048),
    ("top_p top_k", {"temperature": 1.0, "top_p": 0.95, "top_k": 20}, 64),
]


@pytest.mark.parametrize(("name", "settings", "rows"), CASES, ids=[case[0] for case in CASES])
def test_the_trainers_log_prob_is_float32_arithmetic_on_bf16_logits(
    name: str, settings: dict[str, Any], rows: int
) -> None:
    """Identical bf16 logits on both sides: TRL's own log-prob (its function, its dtype) carries bf16 rounding, a
    completion's weight drifts from 1; TRL's + the fix's shift is vLLM's float32 log-prob, the weight is 1."""
    logits = bf16_logits(rows)
    entropy = -(torch.softmax(logits.float(), -1) * torch.log_softmax(logits.float(), -1)).sum(-1).mean()
    assert 1.5 < float(entropy) < 3.5, entropy  # the spread the issue measured the drift on
    ids, engine = vllm_log_probs(logits, settings)
    temperature = settings["temperature"]
    trl = trls_log_probs(logits, ids, temperature)
    assert trl.dtype == torch.bfloat16  # TRL 1.9.1's log-probs of a bf16 model's logits are bf16

    distribution = read_distribution(settings, None)
    assert isinstance(distribution, SamplingDistribution)
    positions = processed.Positions(torch.zeros(rows, 1), None, logits)
    assert positions.trl_rounds
    shift, log_kept = processed.score(positions, ids, distribution, temperature).finish(trl)
    fixed = trl.float() + shift

    if rows == 2048:  # the bug, on TRL's own arithmetic: the weight of a 2,048-token completion is bf16 rounding
        assert abs(sequence_weight(trl, engine) - 1.0) > 1e-2, sequence_weight(trl, engine)
    assert torch.all(torch.isfinite(fixed))
    assert float((fixed - engine).abs().max()) < 1e-5
    assert abs(sequence_weight(fixed, engine) - 1.0) < 1e-4, sequence_weight(fixed, engine)
    if not distribution.changes_anything:
        assert torch.all(log_kept == 0)  # nothing cut: the share kept is all of it


def test_trls_float32_log_softmax_is_replaced_by_vllms_arithmetic_too() -> None:
    """Float32 logits (a float32 model on TRL 1.9.1): TRL's float32 branch subtracts a log-sum-exp, vLLM runs
    ``log_softmax``: a few 1e-7 per token, one-signed, over a 2,048-token completion more than 1e-4 of the weight.
    The fix's log-prob is vLLM's arithmetic there too."""
    logits = bf16_logits(2048).float()
    ids, engine = vllm_log_probs(logits, {"temperature": 1.0})
    trl = trls_log_probs(logits, ids, 1.0)
    assert trl.dtype == torch.float32
    assert abs(sequence_weight(trl, engine) - 1.0) > 1e-4, sequence_weight(trl, engine)
    positions = processed.Positions(torch.zeros(2048, 1), None, logits)
    shift, log_kept = processed.score(positions, ids, SamplingDistribution(temperature=1.0), 1.0).finish(trl)
    assert abs(sequence_weight(trl + shift, engine) - 1.0) < 1e-4, sequence_weight(trl + shift, engine)
    assert torch.all(log_kept == 0)


def test_the_projection_runs_in_the_dtype_of_the_models_own_and_casts_the_weight_once() -> None:
    """TRL 1.16's fused head multiplies in autocast's dtype where it is on, else the hidden states' (a bf16 model:
    bf16 products, the engine's), and in float32 under ``cast_lm_head_to_fp32``; the fix's projection takes the dtype
    read in the forward, and casts a float32 master weight once per layer, not per chunk."""
    hidden = torch.randn(6, 8)
    assert processed.product_dtype(hidden) == torch.float32
    assert processed.product_dtype(hidden.to(torch.bfloat16)) == torch.bfloat16
    assert processed.product_dtype(hidden.to(torch.bfloat16), float32_head=True) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert processed.product_dtype(hidden) == torch.bfloat16
    layer = processed.OutputLayer(torch.randn(64, 8))
    bf16 = processed.Positions(hidden, layer, dtype=torch.bfloat16)
    ids = torch.arange(6)
    expected = (hidden.to(torch.bfloat16) @ layer.weight.to(torch.bfloat16).T).float()
    assert torch.equal(bf16.rows(slice(0, 6)), expected)  # bf16 products, as the fused head's tiles
    assert torch.equal(bf16.sampled(slice(0, 6), ids), expected.gather(1, ids[:, None]).squeeze(1))
    assert torch.equal(bf16.columns(slice(0, 6), ids[:2]), expected[:, :2])
    assert list(layer._cast) == [torch.bfloat16]  # one cast of the weight for every read above
    assert torch.equal(processed.Positions(hidden, layer).rows(slice(0, 6)), hidden @ layer.weight.T)


@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["temperature 1", "temperature 0.7"])
def test_trl_116s_fused_head_is_projected_again_where_the_engine_runs_v1(temperature: float) -> None:
    """TRL 1.16's real fused head on a bf16 output layer whose product is the engine's bf16 logits: its online
    log-sum-exp (the temperature a multiplication by its reciprocal) is not V1's ``log_softmax`` of the divided
    logits, one-signed, so a 2,048-token completion's weight is off by more than 1e-4; the fix projects the hidden
    states again and runs the engine's own steps on them: vLLM's log-prob bit for bit, the weight 1."""
    chunked = pytest.importorskip("trl.kernels.chunked_logprob", reason="TRL 1.16's fused head is not installed")
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2048, 64, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(VOCABULARY, 64, generator=generator) * (SCALE / 8)).to(torch.bfloat16)
    logits = torch.nn.functional.linear(hidden, weight)  # the engine's output layer: bf16 logits
    ids, engine = vllm_log_probs(logits, {"temperature": temperature})
    with torch.no_grad():
        trl = chunked.ChunkedLogProbFunction.apply(hidden, weight, None, ids, temperature, 32768, None, 1.0, ())[0]
    assert trl.dtype == torch.float32
    assert abs(sequence_weight(trl, engine) - 1.0) > 1e-4, sequence_weight(trl, engine)  # the bug, on TRL's kernel

    positions = processed.Positions(hidden, processed.OutputLayer(weight))
    distribution = SamplingDistribution(temperature=temperature)
    assert processed.Scorer(distribution, temperature).own_plain(positions)
    shift, log_kept = processed.score(positions, ids, distribution, temperature).finish(trl)
    assert torch.equal(trl + shift, engine), float((trl + shift - engine).abs().max())
    assert abs(sequence_weight(trl + shift, engine) - 1.0) < 1e-4
    assert torch.all(log_kept == 0)


def test_a_cut_at_trls_temperature_takes_its_kept_share_from_trls_float32_normaliser() -> None:
    """Truncation where TRL's log-prob is float32 at the sampling temperature: the kept share comes from TRL's own
    normaliser (no log-sum-exp over the vocabulary for a metric), equal to the one the fix computes itself."""
    logits = bf16_logits(16).float()
    settings = {"temperature": 1.0, "top_k": 20}
    ids, engine = vllm_log_probs(logits, settings)
    trl = trls_log_probs(logits, ids, 1.0)
    distribution = read_distribution(settings, None)
    assert isinstance(distribution, SamplingDistribution)
    floats = processed.Positions(torch.zeros(16, 1), None, logits)
    rounded = processed.Positions(torch.zeros(16, 1), None, logits.to(torch.bfloat16))  # same values, bf16 dtype
    deferred = processed.score(floats, ids, distribution, 1.0)
    assert torch.all(torch.isnan(deferred.log_kept)) and not torch.any(torch.isnan(deferred.kept_lse))
    shift, log_kept = deferred.finish(trl)
    _, own_log_kept = processed.score(rounded, ids, distribution, 1.0).finish(trl)
    assert torch.allclose(log_kept, own_log_kept, atol=1e-5)
    assert float((trl + shift - engine).abs().max()) < 1e-5
    assert float(log_kept.max()) < 0  # top_k=20 of 4,096 cuts: the share is below 1 on every row


# --- TRL's real GRPOTrainer, a bf16 model's logits on both sides ---------------------------------------------------


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bf16-logits tests' checkpoint (only they serve it: the engine stand-in keeps one served model per
    checkpoint, built with their bf16 output layer)."""
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("peaked-bf16"), sharpness=20.0)


@pytest.fixture(scope="module")
def float32_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("peaked-float32"), sharpness=20.0)


@pytest.fixture
def bf16_model_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Qwen3.5 VLM built during the test gives bf16 logits, as a bf16 model's output layer does: the backbone's
    last hidden states and the output layer's weight are bf16 in its product, which is bf16. TRL 1.9.1's scoring and
    loss passes get bf16 logits, TRL 1.16's fused head multiplies the same bf16 tiles, the engine stand-in upcasts
    its own to float32 as vLLM does; the rest of the model stays float32 (the engine's decode and the trainer's
    forward give the same hidden states: a mismatch of their own would hide the arithmetic)."""
    import transformers

    model_class = transformers.Qwen3_5ForConditionalGeneration
    post_init = model_class.post_init

    def bf16_post_init(self: Any) -> None:
        post_init(self)
        head = self.get_output_embeddings()

        def bf16_product(hidden: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(hidden.to(torch.bfloat16), head.weight.to(torch.bfloat16), head.bias)

        def bf16_hidden_states(module: Any, args: Any, output: Any) -> None:
            output.last_hidden_state = output.last_hidden_state.to(torch.bfloat16)

        head.forward = bf16_product
        self.base_model.register_forward_hook(bf16_hidden_states)

    monkeypatch.setattr(model_class, "post_init", bf16_post_init)


def trls_scoring_pass_makes_logits() -> bool:
    """TRL 1.9.1's scoring pass reads ``.logits`` from the model; TRL 1.16's fused head makes none (float32 inside)."""
    import inspect

    from trl import GRPOTrainer

    return ".logits" in inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)


@pytest.mark.parametrize("temperature", [1.0, 0.8], ids=["temperature 1", "temperature 0.8"])
def test_grpo_with_a_bf16_models_logits_weighs_one_with_the_fix(
    temperature: float,
    peaked_model_dir: Path,
    bf16_model_logits: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    one_fix_off: Callable[[str], None],
) -> None:
    """TRL's real GRPOTrainer, colocate, the engine stand-in (vLLM's Sampler), identical weights, bf16 logits, the
    plugin's default ban, no truncation, 96-token completions: upstream the weight is bf16 rounding (TRL 1.9.1) and
    the ban the trainer does not know (every TRL); with the fix 1."""
    import trl.generation.vllm_generation as vllm_generation
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.fixtures import build_trainer, text_dataset

    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    processor = AutoProcessor.from_pretrained(peaked_model_dir)
    projected: list[int] = []  # positions whose plain log-prob came from hidden states projected again (TRL 1.16)
    plain = processed.Positions.plain_log_probs

    def counting(self: Any, *args: Any) -> torch.Tensor:
        if self.raw is None:
            projected.append(len(self))
        return plain(self, *args)

    monkeypatch.setattr(processed.Positions, "plain_log_probs", counting)

    def train(out: str) -> dict[str, float]:
        trainer = build_trainer(
            peaked_model_dir,
            processor,
            str(tmp_path / out),
            use_vllm=True,
            vllm_mode="colocate",
            max_steps=1,
            max_completion_length=96,
            temperature=temperature,
            generation_kwargs={"seed": 0, "ignore_eos": True},  # every completion is 96 tokens: no row masked away
            dataset=text_dataset(),
        )
        trainer.train()
        return next(log for log in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in log)

    fixed = train("on")
    # TRL 1.16's fused head gives no logits: the fix projected the hidden states again (TRL 1.9.1: read its logits)
    assert bool(projected) != trls_scoring_pass_makes_logits(), projected
    one_fix_off("sampling_parity")
    upstream = train("off")
    for log in (fixed, upstream):
        assert log["completions/min_length"] == 96, log  # the ratio is over every completion's 96 tokens
    drift = max(abs(upstream[f"sampling/importance_sampling_ratio/{k}"] - 1.0) for k in ("min", "max"))
    assert drift > 1e-3, upstream
    for key in ("min", "mean", "max"):
        assert abs(fixed[f"sampling/importance_sampling_ratio/{key}"] - 1.0) < 1e-4, fixed
    assert fixed["sampling/sampling_logp_difference/max"] < 1e-5, fixed
    assert fixed["trl_vlm_fixes/sampling_kept_mass"] < 1.0  # the ban acted (placeholders are as likely as any token)


@pytest.mark.parametrize("cut", [{"top_k": 20}, {}], ids=["top_k (one row at a time)", "ban alone (the call)"])
def test_positions_after_a_completion_ended_are_not_scored(
    cut: dict[str, Any], float32_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fix's passes over the vocabulary read only the positions TRL's completion mask keeps: a batch padded to
    its longest completion scores no padding (TRL 1.9.1's logits: the cut's rows and the ban's call alike; TRL 1.16's
    fused head: the positions projected for the cut, and for the ban's plain pass), and the ratio is still 1."""
    import trl.generation.vllm_generation as vllm_generation
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.fixtures import build_trainer, text_dataset

    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    read: list[int] = []
    log_softmax = torch.log_softmax  # the fix's (vLLM's arithmetic); TRL and vLLM's Sampler call other functions
    plain = processed.Positions.plain_log_probs
    in_plain_pass = [False]

    def counting(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if cut or in_plain_pass[0]:  # the ban's own full rows (positions it may dominate) are not its plain pass
            read.append(logits.size(0))
        return log_softmax(logits, *args, **kwargs)

    def plain_pass(self: Any, *args: Any) -> torch.Tensor:
        in_plain_pass[0] = True
        try:
            return plain(self, *args)
        finally:
            in_plain_pass[0] = False

    monkeypatch.setattr(torch, "log_softmax", counting)
    monkeypatch.setattr(processed.Positions, "plain_log_probs", plain_pass)
    trainer = build_trainer(
        float32_model_dir,
        AutoProcessor.from_pretrained(float32_model_dir),
        str(tmp_path / "out"),
        use_vllm=True,
        vllm_mode="colocate",
        max_steps=1,
        max_completion_length=24,
        # a fifth of the vocabulary stops a sequence: completions of different lengths, padded to the longest
        generation_kwargs={**cut, "stop_token_ids": list(range(0, 240, 5))},
        dataset=text_dataset(),
    )
    trainer.train()
    log = next(log for log in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in log)
    completions = trainer.args.per_device_train_batch_size
    assert log["completions/min_length"] < log["completions/max_length"], log  # some rows are padded
    for key in ("min", "mean", "max"):
        assert abs(log[f"sampling/importance_sampling_ratio/{key}"] - 1.0) < 1e-5, (key, log)
    assert sum(read) == round(log["completions/mean_length"] * completions), (read, log)
    assert sum(read) < completions * log["completions/max_length"]
