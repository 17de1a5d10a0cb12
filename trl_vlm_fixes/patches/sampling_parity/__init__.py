"""sampling_parity: TRL's importance-sampling ratio compares vLLM's log-probs with the trainer's of the same
distribution, so it measures only the engine/trainer mismatch it exists for.

TRL builds its vLLM engines with ``logprobs_mode="processed_logprobs"`` (colocate and ``trl vllm-serve``): the
log-probability vLLM returns for a sampled token is taken after its bans (``logit_bias`` -inf, ``bad_words``), biases,
temperature, ``min_p``, top-k and top-p, renormalised over the tokens that survive. GRPO's scoring pass computes the
trainer's log-probability over the full vocabulary. Per token the two differ by -log(kept share), exactly, and TRL's
``vllm_importance_sampling_correction`` (on by default, ``sequence_mask``) multiplies every token's loss by
exp(sum over the completion of trainer - vLLM log-prob): the sequence weight is the product of the kept shares. The
plugin's own placeholder ban (1e-4 of the mass per token) leaves 0.66 of the weight at 4,096 tokens; top_p=0.95 with
top_k=20 leaves almost nothing (huggingface/trl#6789, open). ``sampling/sampling_logp_difference`` and the off-policy
mask are inflated alike, and a ``clip_min`` drops such rows.

The fix, in GRPO's ``_generate_and_score_completions`` (where TRL scores a rollout and computes the ratio):

- every ``VLLMGeneration.generate`` of the rollout records the distribution vLLM was asked for, as TRL builds the
  ``SamplingParams`` (``distribution.py``);
- the scoring pass that gives TRL's ``old_per_token_logps`` (the first, no-gradient forward of the trainer's model
  there) also gives, from the same logits, each sampled token's log-prob under that distribution at its temperature
  (``processed.py``: a subtraction for a ban alone at TRL's temperature; otherwise vLLM's own functions in its
  sampler's order, its top-k/top-p the one every engine step takes, ``vllm_rule``/``engine_sampler``). TRL computes
  its ratio, ``sampling/sampling_logp_difference`` and the ratio metrics from those;
- what TRL hands to the loss is put back as TRL meant it: ``old_per_token_logps`` is TRL's own (the policy loss stays
  TRL's), and ``sampling_per_token_logps`` (read by the off-policy mask against the full-vocabulary policy) becomes
  vLLM's log-prob plus the same shift, i.e. vLLM's sampling log-prob expressed over the full vocabulary. With the
  off-policy mask on and the correction off, TRL's rollout runs that scoring pass as with the correction on, and
  what TRL would not have made (the ratio, its metrics, old log-probs TRL leaves to the loss) is taken out again.

Where ``generation_kwargs`` sets another temperature than ``GRPOConfig.temperature``, vLLM samples (and reports its
log-probs) at the former and TRL scores at the latter: the fix compares both at the sampling temperature, so the
ratio measures the engine/trainer mismatch only; the policy loss keeps TRL's own log-probs at its temperature.

``trl_vlm_fixes/sampling_kept_mass`` reports the mean share of the trainer's distribution the settings keep, per
sampled token (1.0: nothing truncated). Settings whose effect depends on what was generated so far (penalties,
``min_tokens``, a bad word of several tokens, structured outputs, custom logits processors), a greedy temperature, an
engine that returns raw log-probs, or a rollout that did not go through TRL's ``VLLMGeneration.generate`` (a
``rollout_func`` with its own engine) cannot be modelled: the ratio is then TRL's, and one WARNING names why.
RLOO asks vLLM for no log-probs and computes no such ratio: the fix is not needed there.
"""

from __future__ import annotations

import ast
import logging
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from ... import metrics, ratio_pass
from ...call_arguments import bind
from ...declaration import VLLM_MODES, Applicability, Counter, Fix, Target, on_trainers
from ...log_once import warn_once
from ...logs import fix_logger
from ...owner_state import OwnerState
from ...source_shape import function_tree, string_constants
from .distribution import (
    V1_RUNNER,
    V2_RUNNER,
    SamplingDistribution,
    effective_settings,
    read_distribution,
)
from .engine_sampler import ENGINE_SAMPLER_TARGETS, routed

LOGGER = fix_logger(__name__)
SAMPLING_KEPT_MASS = Counter("trl_vlm_fixes/sampling_kept_mass", kind="mean")
_GENERATION_MODULE = "trl.generation.vllm_generation"
_SCORING = "_get_per_token_logps_and_entropies"
_ROLLOUT = "_generate_and_score_completions"


@dataclass
class _Rollout:
    """One ``_generate_and_score_completions``: what vLLM was asked for, and what the scoring pass gave."""

    distributions: list[SamplingDistribution | str] = field(default_factory=list)  # one per generate
    scored: bool = False  # the old-logps scoring pass has been seen (only the first one is TRL's old logps)
    trl_logps: Any = None  # TRL's own old_per_token_logps (full vocabulary)
    processed_logps: Any = None  # what TRL computed its ratio from
    shift: Any = None
    log_kept: Any = None

    def distribution(self) -> SamplingDistribution | str:
        if not self.distributions:
            return (
                "the rollout did not go through TRL's VLLMGeneration.generate (a rollout_func with its own engine?): "
                "the sampling settings are unknown"
            )
        first = self.distributions[0]
        if isinstance(first, str):
            return first
        if any(other != first for other in self.distributions[1:]):
            return "the turns of this rollout were sampled with different settings"
        return first


_current: ContextVar[_Rollout | None] = ContextVar("trl_vlm_fixes_sampling_parity", default=None)
# a trainer's last rollout whose scoring pass its loss passes run instead (scoring_skip, ``ratio_pass``)
_deferred_rollouts: OwnerState[_Rollout | None] = OwnerState(lambda: None)


# --- what vLLM was asked for ---------------------------------------------------------------------------------------


def record_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``VLLMGeneration.generate``: inside a trainer's rollout, record the distribution this call samples from."""
    rollout = _current.get()
    if rollout is None:  # no ratio of TRL's reads this rollout: its engine samples as vLLM built it
        return wrapped(*args, **kwargs)
    try:
        rollout.distributions.append(_asked_for(instance))
    except Exception as error:  # noqa: BLE001 - reading settings must never break a rollout
        rollout.distributions.append(f"its sampling settings could not be read ({error!r})")
    with routed():  # this engine's steps take one knowable top-k/top-p rule (engine_sampler)
        return wrapped(*args, **kwargs)


def _asked_for(generation: Any) -> SamplingDistribution | str:
    mode = _logprobs_mode(generation)
    if mode not in (None, "processed_logprobs"):
        return f"the engine returns {mode}, not processed_logprobs"
    processing = getattr(generation, "processing_class", None)
    tokenizer = getattr(processing, "tokenizer", processing)
    distribution = read_distribution(effective_settings(generation), tokenizer)
    if isinstance(distribution, str):
        return distribution
    return replace(distribution, runner=_engine_runner(generation, distribution))


def _runner_matters(distribution: SamplingDistribution) -> bool:
    """The V2 runner's steps differ from V1's in what the trainer reproduces: its min-p rule, and its temperature
    kernel (compiled on CUDA, not IEEE division) at any temperature other than 1."""
    return distribution.min_p > 0.0 or distribution.temperature != 1.0


def _server_runs_v1(generation: Any) -> bool:
    """The server's vLLM (taken to be this environment's) builds V1 for this model: before 0.29 it builds V2 only for
    models neither hybrid nor MoE (Qwen3.5 and every MoE family keep V1), unless ``VLLM_USE_V2_MODEL_RUNNER`` is
    set."""
    import os

    from ...model_facts import has_gated_deltanet
    from ...moe_backend import has_routed_experts
    from ...versions import installed_version

    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") is not None:
        return os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    try:
        major, minor = (int(part) for part in (installed_version("vllm") or "").split(".")[:2])
    except ValueError:  # not installed, or not a numbered release
        return False
    config: Any = getattr(getattr(generation, "model", None), "config", None)
    to_dict = getattr(config, "to_dict", None)
    as_dict = to_dict() if callable(to_dict) else None
    if (major, minor) >= (0, 29) or not isinstance(as_dict, dict):
        return False
    return has_gated_deltanet(as_dict) or has_routed_experts(config)


def _engine_runner(generation: Any, distribution: SamplingDistribution) -> str:
    """The runner of the engine that samples this rollout. vLLM's V2 model runner (0.25.1's default for models
    neither hybrid nor MoE: Qwen3-VL, Qwen2.5-VL; 0.29+'s for every family) cuts min-p at logit < max + log(min_p),
    V1 at prob < min_p * max prob, and divides by the temperature in a Triton kernel (approximate division on CUDA:
    ``engine_steps.py``); its log-softmax kernel rounds otherwise than V1's ``log_softmax`` (one-signed on peaked
    logits: up to 5.7e-4 of a 2,048-token weight on an H100), its bias and bad-words kernels set -inf or add in
    float32 as V1's do (``tests/test_v2_runner.py`` runs them in Triton's interpreter,
    ``benchmarks/gpu/v2_sampler_kernels.py`` and ``logprob_arithmetic.py`` compiled). The colocated engine's runner is
    read from its config; a server's cannot be read from the trainer: V1's steps are kept, and one WARNING says so
    where the server may run V2 (not for a model that vLLM before 0.29 serves with V1)."""
    if getattr(generation, "mode", None) == "colocate":
        config = getattr(getattr(getattr(generation, "llm", None), "llm_engine", None), "vllm_config", None)
        if getattr(config, "use_v2_model_runner", False) is True:
            if not _runner_matters(distribution):
                return V2_RUNNER
            warn_once(
                ("sampling_parity", "V2 model runner"),
                "the colocated engine runs vLLM's V2 model runner: the trainer applies its steps (its temperature "
                "kernel, its min-p rule: logit < max logit + log(min_p))",
                logger=LOGGER,
                level=logging.INFO,
            )
            return V2_RUNNER
        return V1_RUNNER
    if _server_runs_v1(generation):
        return V1_RUNNER
    warn_once(
        ("sampling_parity", "server runner"),
        f"{distribution.describe()} and TRL's server engine's model runner cannot be read from the trainer: the "
        "trainer applies vLLM's V1 sampler's steps and log-softmax; vLLM's V2 runner (0.25.1's default for models "
        "neither hybrid nor MoE, every model's from 0.29) rounds its log-softmax otherwise (up to 6e-4 of a "
        "2,048-token completion's weight), cuts min-p at logit < max + log(min_p) and divides by the temperature in "
        "a kernel of its own, which moves the min-p boundary token and the approximate top-p cut. Start the server "
        "with VLLM_USE_V2_MODEL_RUNNER=0 to make the ratio exact there.",
        logger=LOGGER,
    )
    return V1_RUNNER


def _logprobs_mode(generation: Any) -> str | None:
    """The colocated engine's own setting where it can be read (TRL 1.9.1 and 1.16 build it with processed_logprobs;
    ``trl vllm-serve`` too, and TRL 1.16's trainer refuses a server without it)."""
    if getattr(generation, "mode", None) != "colocate":
        return None
    config = getattr(getattr(getattr(generation, "llm", None), "llm_engine", None), "model_config", None)
    mode = getattr(config, "logprobs_mode", None)
    return getattr(mode, "value", mode) if mode is not None else None


# --- the rollout and its scoring pass ---------------------------------------------------------------------------


def _trainer_steps_aside(trainer: Any) -> str | None:
    if not getattr(trainer, "use_vllm", False):
        return "use_vllm is off: TRL samples with transformers and compares no vLLM log-probs"
    if not _ratio_on(trainer) and not _mask_on(trainer):
        return (
            "vllm_importance_sampling_correction is off and off_policy_mask_threshold unset: TRL compares no vLLM "
            "log-probs"
        )
    if not _ratio_on(trainer) and (drift := _old_logps_rule_drift(type(trainer))):
        return f"the off-policy mask with the correction off: {drift}"
    return None


# TRL's own rule (grpo_trainer.py, TRL 1.9.1-1.16) for scoring old log-probs without the IS correction: the fix
# replays it when it forces the scoring pass for the off-policy mask, so it must still be TRL's
_OLD_LOGPS_RULE = (
    "generate_every = self.args.steps_per_generation * self.num_iterations",
    "self.args.gradient_accumulation_steps % generate_every != 0",
)


def _old_logps_rule_drift(trainer_class: type) -> str | None:
    """Why this TRL's rule for scoring old log-probs is no longer the one the fix replays (read from its source), or
    None."""
    method = getattr(trainer_class, _ROLLOUT, None)
    tree = function_tree(getattr(method, "__wrapped__", method)) if method is not None else None
    if tree is None:
        return f"{_ROLLOUT}'s source cannot be read to check TRL's rule for old log-probs"
    source = ast.unparse(tree)
    missing = [line for line in _OLD_LOGPS_RULE if line not in source]
    return f"TRL's rule for scoring old log-probs changed (no `{missing[0]}` in {_ROLLOUT})" if missing else None


def _ratio_on(trainer: Any) -> bool:
    return bool(getattr(trainer, "vllm_importance_sampling_correction", False))


def _mask_on(trainer: Any) -> bool:
    return getattr(trainer, "off_policy_mask_threshold", None) is not None


def rollout_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """GRPO's ``_generate_and_score_completions``: the rollout's distribution, TRL's ratio from processed log-probs,
    and TRL's own tensors handed on to the loss (the off-policy mask's sampling log-probs in full-vocabulary terms)."""
    if reason := _trainer_steps_aside(instance):
        _step_aside(type(instance).__name__, reason, logging.INFO)
        return wrapped(*args, **kwargs)
    rollout = _Rollout()
    token = _current.set(rollout)
    try:
        with _old_logps_scored(instance) as upstream_would:
            output = wrapped(*args, **kwargs)
    finally:
        _current.reset(token)
    if isinstance(output, dict):
        upstream_would(output)
        if rollout.processed_logps is not None:
            if output.get("old_per_token_logps") is rollout.processed_logps:
                output["old_per_token_logps"] = rollout.trl_logps
            _hand_on(instance, rollout, output)
        elif ratio_pass.deferred(output):  # scoring_skip: each loss pass scores its micro-batch
            _deferred_rollouts.set(instance, rollout)
    return output


_RATIO_METRICS = tuple(
    f"sampling/{name}" for name in ("sampling_logp_difference/mean", "sampling_logp_difference/max")
) + tuple(f"sampling/importance_sampling_ratio/{name}" for name in ("min", "mean", "max"))


@contextmanager
def _old_logps_scored(trainer: Any) -> Iterator[Callable[[dict[str, Any]], None]]:
    """With the off-policy mask on and the correction off, TRL's rollout may score no old log-probs, and the mask
    would compare vLLM's processed log-probs with the full-vocabulary policy. For the rollout, TRL runs its scoring
    pass as with the correction on (its ``vllm_importance_sampling_correction`` read as True); then what TRL would not
    have made is taken out again: the ratio, its metrics, and old log-probs TRL would have left to the loss."""
    if _ratio_on(trainer):
        yield lambda output: None
        return
    metrics_before = {
        mode: {key: len(values[key]) for key in _RATIO_METRICS if key in values}
        for mode, values in getattr(trainer, "_metrics", {}).items()
    }
    args = getattr(trainer, "args", None)
    generate_every = getattr(args, "steps_per_generation", 1) * getattr(trainer, "num_iterations", 1)
    trl_scores_old = getattr(args, "gradient_accumulation_steps", 1) % generate_every != 0  # _OLD_LOGPS_RULE

    def upstream_would(output: dict[str, Any]) -> None:
        output.pop("importance_sampling_ratio", None)
        if not trl_scores_old:
            output.pop("old_per_token_logps", None)
        for mode, values in getattr(trainer, "_metrics", {}).items():
            for key in _RATIO_METRICS:
                if key in values:
                    before = metrics_before.get(mode, {}).get(key)
                    if before is None:
                        del values[key]
                    else:
                        del values[key][before:]

    setting = trainer.vllm_importance_sampling_correction
    trainer.vllm_importance_sampling_correction = True
    try:
        yield upstream_would
    finally:
        trainer.vllm_importance_sampling_correction = setting


def scoring_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_get_per_token_logps_and_entropies``: the first no-gradient pass of the trainer's model inside a rollout is
    TRL's ``old_per_token_logps`` (checked in TRL's source, ``_old_logps_first``); it returns them processed."""
    if (loss_pass := ratio_pass.current_loss_pass()) is not None:
        return _loss_pass_scored(wrapped, instance, args, kwargs, loss_pass)
    rollout = _current.get()
    if rollout is None or rollout.scored or ratio_pass.rollout_deferred():
        return wrapped(*args, **kwargs)
    import torch

    bound = bind(wrapped, args, kwargs)
    model = bound.arguments.get("model")
    if model is not getattr(instance, "model", None) or torch.is_grad_enabled():
        return wrapped(*args, **kwargs)
    rollout.scored = True
    scored = _processed(wrapped, instance, args, kwargs, rollout)
    if isinstance(scored, tuple):
        return scored
    rollout.trl_logps, rollout.shift, rollout.log_kept = scored.trl_logps, scored.shift, scored.log_kept
    rollout.processed_logps = scored.processed
    return (rollout.processed_logps, *scored.result[1:])


def _loss_pass_scored(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any], loss_pass: Any
) -> Any:
    """A loss pass standing in for the rollout's scoring pass (``scoring_skip``): the processed log-probs of its
    micro-batch, from its own logits, for TRL's ratio (``ratio_pass``); the loss keeps TRL's result as it is."""
    rollout = _deferred_rollouts.get(instance)
    if rollout is None or loss_pass.scored:
        return wrapped(*args, **kwargs)
    scored = _processed(wrapped, instance, args, kwargs, rollout)
    if isinstance(scored, tuple):
        return scored
    loss_pass.ratio_logps = scored.processed
    _hand_on(instance, scored, loss_pass.inputs)
    return scored.result


@dataclass
class _Processed:
    """One scoring call: TRL's result, and its scored positions' log-probs under the rollout's distribution."""

    result: Any
    trl_logps: Any
    shift: Any
    log_kept: Any
    processed: Any


def _processed(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rollout: _Rollout
) -> _Processed | tuple[Any, ...]:
    """TRL's call with its scored positions processed, or TRL's result alone where the fix steps aside (said once).
    TRL's tensors are only read (detached: a loss pass's carry gradients)."""
    import torch

    bound = bind(wrapped, args, kwargs)
    model = bound.arguments.get("model")
    distribution = rollout.distribution()
    parts = distribution if isinstance(distribution, str) else _model_parts(model)
    if isinstance(parts, str):
        _step_aside(type(instance).__name__, parts, logging.WARNING)
        return wrapped(*args, **kwargs)
    assert isinstance(distribution, SamplingDistribution)
    from .processed import Scorer
    from .vllm_rule import size_dependent_top_p

    head = parts[2]
    vocabulary = int(getattr(head, "out_features", 0) or head.weight.size(0))
    if reason := size_dependent_top_p(distribution.top_k, distribution.top_p, head.weight.device, vocabulary):
        _step_aside(type(instance).__name__, reason, logging.WARNING)
        return wrapped(*args, **kwargs)

    # every distribution, the plain one too: where TRL's log-prob carries bf16 rounding, the fix's is float32
    keep = int(bound.arguments.get("logits_to_keep") or 0)
    scorer = Scorer(distribution, float(getattr(instance, "temperature", 1.0)))
    float32_head = bool(getattr(getattr(instance, "args", None), "cast_lm_head_to_fp32", False))
    with _scored_positions(*parts, keep, scorer, float32_head) as pass_:
        result = wrapped(*args, **kwargs)
    reason = pass_.problem or (
        "the scoring pass did not give one hidden state per scored token"
        if not pass_.scored or sum(part.processed.numel() for part in pass_.scored) != result[0].numel()
        else None
    )
    if reason:
        _step_aside(type(instance).__name__, reason, logging.WARNING)
        return result
    logps = result[0].detach()
    shift, log_kept = _finished(pass_.scored, logps)
    mask = bound.arguments.get("attention_mask")
    if mask is not None and mask.dim() == 2 and mask[:, -shift.size(-1) :].shape == shift.shape:
        # where TRL's mask ends a completion its log-prob is not a sampled token's (TRL 1.16 gives 0): nothing there
        scored = mask[:, -shift.size(-1) :].ne(0)
        shift, log_kept = shift.where(scored, 0.0), log_kept.where(scored, 0.0)
    _announce(distribution)
    return _Processed(result, logps, shift, log_kept, logps.to(torch.float32) + shift)


_SHARDED = "the output layer is sharded across ranks (FSDP or DeepSpeed ZeRO-3)"


def _model_parts(model: Any) -> tuple[Any, Any, Any, Any] | str:
    """(the model TRL calls, unwrapped; the backbone whose last hidden states the output layer projects; the output
    layer module; its projection, or None where its weight is sharded: TRL 1.9.1's logits are then read, and only
    TRL 1.16's fused head, which makes none, needs the whole weight), or why they cannot be used: the output layer
    must be a plain projection (no logit scale or softcap)."""
    from .processed import OutputLayer

    inner = model
    while hasattr(inner, "module"):  # DDP, DeepSpeed
        inner = inner.module
    if hasattr(inner, "get_base_model"):  # PEFT
        inner = inner.get_base_model()
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    backbone = getattr(inner, "base_model", None)
    weight = getattr(head, "weight", None)
    if head is None or backbone is None or backbone is inner or weight is None:
        return f"{type(inner).__name__} has no output layer over a backbone to read"
    text = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "logits_scaling"):
        if getattr(text, name, None) not in (None, 1.0):
            return f"the model scales its logits ({name})"
    sharded = weight.dim() != 2 or type(weight).__name__ == "DTensor" or getattr(weight, "ds_numel", None) is not None
    layer = None if sharded else OutputLayer(weight, getattr(head, "bias", None))
    return inner, backbone, head, layer


@dataclass
class _Pass:
    """What one scoring pass gave: a ``Scored`` per TRL model call (or per row of it), or why it could not."""

    scored: list[Any] = field(default_factory=list)
    problem: str | None = None


@contextmanager
def _scored_positions(
    inner: Any, backbone: Any, head: Any, layer: Any, keep: int, scorer: Any, float32_head: bool = False
) -> Iterator[_Pass]:
    """While TRL's pass runs, each of its model calls (one per TRL chunk) also scores its last ``keep`` tokens: the
    backbone's forward hook takes the hidden states that predict them; where the output layer then runs (TRL 1.9.1),
    its hook scores them from its logits before TRL divides those in place, else (TRL 1.16's fused head) the model's
    own forward hook scores them from the hidden states as the call returns, so no call's hidden states outlive it;
    they are projected in the dtype the fused head's tiles had, read in the backbone's hook, inside the forward and its
    autocast (``float32_head``: TRL's ``cast_lm_head_to_fp32``). TRL's tensors are only read."""
    import torch

    from .processed import Positions, Scored, product_dtype

    pass_ = _Pass()
    # (hidden states, sampled ids, kept, attention mask of the scored positions, projection dtype) of the call
    waiting: list[tuple[Any, Any, int, Any, Any]] = []

    def on_backbone(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        hidden = getattr(output, "last_hidden_state", None)
        if input_ids is None or hidden is None:
            return
        kept = keep or input_ids.size(1) - 1
        mask = kwargs.get("attention_mask")
        scored_mask = mask[:, -kept:] if mask is not None and mask.dim() == 2 else None
        # position j predicts j + 1
        scored = hidden[:, -(kept + 1) : -1, :]
        waiting.append((scored, input_ids[:, -kept:], kept, scored_mask, product_dtype(scored, float32_head)))

    @torch.no_grad()  # a loss pass's logits carry gradients: the fix's arithmetic stays out of the graph
    def on_head(module: Any, args: Any, output: Any) -> None:
        if waiting and output.dim() == 3 and output.size(1) > waiting[-1][2]:
            hidden, ids, kept, mask, _ = waiting.pop()
            logits = output[:, -(kept + 1) : -1, :]
            lengths = _completion_lengths(mask, output.size(0), kept)
            if scorer.ban_alone:  # gathers from the whole call's logits at once; the rows' log-softmax up to their end
                pass_.scored.append(scorer.score(Positions(hidden, layer, logits, lengths), ids))
                return
            for row, length in enumerate(lengths):
                # one row's positions are a view of TRL's logits (several, a copy); none after the completion ended:
                # padding the loss and the ratio mask away keeps TRL's own log-prob (shift 0)
                scored = scorer.score(Positions(hidden[row, :length], layer, logits[row, :length]), ids[row, :length])
                pass_.scored.append(scored.padded(kept))

    @torch.no_grad()
    def on_model(module: Any, args: Any, output: Any) -> None:
        while waiting:  # the output layer never ran on them (a fused head): project the hidden states
            hidden, ids, kept, mask, dtype = waiting.pop(0)
            if layer is None and scorer.nothing_to_cut:  # TRL's own float32 log-probs: said once
                _sharded_fused_head_once()
                pass_.scored.append(Scored.pending(hidden.new_full(ids.shape, math.nan, dtype=torch.float32).flatten()))
                continue
            if layer is None:
                pass_.problem = f"{_SHARDED} and TRL's fused output layer gives no logits to read"
                continue
            # no plain log-prob made after each completion's end (the loss masks those positions away)
            lengths = _completion_lengths(mask, hidden.size(0), kept)
            pass_.scored.append(scorer.score(Positions(hidden, layer, lengths=lengths, dtype=dtype), ids))

    handles = [backbone.register_forward_hook(on_backbone, with_kwargs=True)]
    handles.append(head.register_forward_hook(on_head))
    handles.append(inner.register_forward_hook(on_model))
    try:
        yield pass_
        on_model(inner, (), None)  # a call whose model forward was not ``inner``'s own
    finally:
        for handle in handles:
            handle.remove()


def _sharded_fused_head_once() -> None:
    warn_once(
        ("sampling_parity", "sharded fused head"),
        f"{_SHARDED} and TRL's fused output layer gives no logits: the plain distribution's log-prob is TRL's own "
        "float32 one (its online log-sum-exp, not the engine's log-softmax: up to 5.6e-4 of a 2,048-token "
        "completion's IS weight against vLLM's V1 on an H100, docs/gpu-results.md section 17)",
        logger=LOGGER,
        level=logging.INFO,
    )


def _completion_lengths(mask: Any, rows: int, kept: int) -> list[int]:
    """Per row, the scored positions up to the last one the attention mask keeps (TRL's completion mask: ones, then
    zeros after the end of the sequence); every position where there is no mask. One read to the host per call."""
    if mask is None:
        return [kept] * rows
    import torch

    positions = torch.arange(1, kept + 1, device=mask.device)
    return [int(length) for length in (mask.ne(0) * positions).amax(dim=1).tolist()]


def _finished(scored: list[Any], trl_logps: Any) -> tuple[Any, Any]:
    import torch

    rows = trl_logps.reshape(-1)
    shifts, kept, start = [], [], 0
    for part in scored:
        end = start + part.processed.numel()
        shift, log_kept = part.finish(rows[start:end])
        shifts.append(shift)
        kept.append(log_kept)
        start = end
    return torch.cat(shifts).reshape(trl_logps.shape), torch.cat(kept).reshape(trl_logps.shape)


def _hand_on(trainer: Any, scored: _Rollout | _Processed, output: dict[str, Any]) -> None:
    """The loss gets vLLM's log-probs in full-vocabulary terms (the off-policy mask reads them against TRL's policy);
    the kept share is counted. ``scored``: a rollout's scoring pass, or a loss pass standing in for it."""
    shift, log_kept = scored.shift, scored.log_kept
    mask = output["completion_mask"]
    if "tool_mask" in output:
        mask = mask * output["tool_mask"]
    shift = shift * mask
    sampling = output.get("sampling_per_token_logps")
    if sampling is not None and sampling.shape == shift.shape:
        output["sampling_per_token_logps"] = sampling - shift
    metrics.count_mean(trainer, SAMPLING_KEPT_MASS, (log_kept.exp() * mask).sum(), mask.sum())


def _step_aside(trainer: str, reason: str, level: int) -> None:
    warn_once(
        ("sampling_parity steps aside", trainer, reason),
        "steps aside for %s: %s. The importance-sampling ratio is TRL's (it includes the share of the distribution "
        "vLLM's settings cut).",
        trainer,
        reason,
        logger=LOGGER,
        level=level,
    )


def _announce(distribution: SamplingDistribution) -> None:
    warn_once(
        ("sampling_parity acts", distribution),
        "the importance-sampling ratio compares vLLM's processed log-probs with the trainer's of the same "
        "distribution (%s); kept share per token in %s.",
        distribution.describe(),
        SAMPLING_KEPT_MASS.name,
        logger=LOGGER,
        level=logging.INFO,
    )


# --- what this TRL does (read from its source) --------------------------------------------------------------------


def _rollout_method(function: Callable[..., Any]) -> Any:
    """The ``_generate_and_score_completions`` of the class defining ``function``."""
    qualname = getattr(function, "__qualname__", "")
    owner = getattr(sys.modules.get(getattr(function, "__module__", "") or ""), qualname.split(".")[0], None)
    return getattr(owner, _ROLLOUT, None)


def _no_ratio(function: Callable[..., Any]) -> str | None:
    """Not needed where the trainer never reads vLLM's log-probs (TRL's RLOO)."""
    method = _rollout_method(function)
    tree = function_tree(method) if method is not None else None
    if tree is None or "sampling_per_token_logps" in string_constants(tree):
        return None
    return "this trainer asks vLLM for no log-probs and computes no importance-sampling ratio"


def _old_logps_first(function: Callable[..., Any]) -> str | None:
    """The shape the scoring wrapper relies on: the first ``_get_per_token_logps_and_entropies`` call of the rollout
    scores ``self.model`` into ``old_per_token_logps``."""
    method = _rollout_method(function)
    tree = function_tree(method) if method is not None else None
    if tree is None:
        return "source unavailable, cannot find where TRL scores old_per_token_logps"
    if "sampling_per_token_logps" not in string_constants(tree):
        return None  # nothing to correct here: _no_ratio says not-needed
    calls = sorted(
        (node for node in ast.walk(tree) if isinstance(node, ast.Assign) and _calls_scoring(node.value)),
        key=lambda node: (node.lineno, node.col_offset),
    )
    if not calls:
        return f"{_ROLLOUT} no longer calls {_SCORING}"
    first = calls[0]
    call = first.value
    assert isinstance(call, ast.Call)
    target = first.targets[0]
    names = [element.id for element in getattr(target, "elts", [target]) if isinstance(element, ast.Name)]
    scored = ast.unparse(call.args[0]) if call.args else ""
    if names[:1] == ["old_per_token_logps"] and scored == "self.model":
        return None
    return f"the first {_SCORING} call of {_ROLLOUT} is no longer TRL's old_per_token_logps of self.model"


def _calls_scoring(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == _SCORING


_CHECKS: dict[str, Any] = {"shape_problem": _old_logps_first, "upstream_fixed": _no_ratio}


def scope(trainer: Any) -> str | None:
    """Where this trainer computes no ratio against vLLM's log-probs (RLOO: none at all; see ``_no_ratio``)."""
    if reason := _trainer_steps_aside(trainer):
        return reason
    method = getattr(type(trainer), _ROLLOUT, None)
    return _no_ratio(getattr(method, "__wrapped__", method)) if method is not None else "it has no rollout to score"


FIX = Fix(
    name="sampling_parity",
    summary="the importance-sampling ratio compares vLLM's processed log-probs with the trainer's of the same "
    "distribution (bans, top-k, top-p, min-p)",
    packages=("trl", "vllm"),
    targets=(
        *on_trainers({_ROLLOUT: rollout_wrapper, _SCORING: scoring_wrapper}, **_CHECKS),
        Target(_GENERATION_MODULE, "VLLMGeneration.generate", record_wrapper, required_parameters=("prompts",)),
        *ENGINE_SAMPLER_TARGETS,
    ),
    counters=(SAMPLING_KEPT_MASS,),
    selftest="trl_vlm_fixes.selftest.checks.sampling_parity:check",
    scope=scope,
    applicability=Applicability(
        modes=VLLM_MODES, aside={"none": "TRL samples with transformers and compares no vLLM log-probs"}
    ),
)
