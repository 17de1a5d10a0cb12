"""scoring_skip: no no-gradient scoring pass that the loss pass repeats: where generation and optimisation are aligned,
the trainer's log-probs of a rollout come from each micro-batch's loss pass, detached.

TRL 1.9.1's GRPO with vLLM and ``vllm_importance_sampling_correction=True`` (its default) runs, in every rollout, a
no-gradient forward of the trainer's model over every prompt + completion of the generation batch (images and vision
encoder included) only to get ``old_per_token_logps`` for the importance-sampling ratio ("When using vLLM, we always
compute old_per_token_logps"); RLOO runs it in every rollout for its ``old_logps``. Where generation and optimisation
are aligned (``gradient_accumulation_steps % (steps_per_generation * num_iterations) == 0`` with
``num_iterations == 1``: TRL's own rule for needing no old log-probs), the weights do not change between that pass and
the loss pass of each micro-batch, so the old log-probs are the loss pass's own, detached (what TRL's loss uses when
there are none): one forward of the whole batch per generation is repeated (verl issue 3996: about a quarter of the
trainer's compute).

Where it acts, TRL's rollout runs without that pass (GRPO: TRL's ``vllm_importance_sampling_correction`` reads False
inside the rollout, which TRL's own rule then leaves without old log-probs, ratio and ratio metrics; RLOO: its scoring
call returns without running the model, ``old_logps`` are set by the loss pass). Each row carries its index in the
generation batch (``ratio_pass.ROW_KEY``) through TRL's shuffle and split. In the loss pass of each micro-batch, once
the policy's log-probs are computed and before TRL's loss reads anything else, the fix computes from them, detached
(or from ``sampling_parity``'s processed log-probs of the same logits, ``ratio_pass``), with TRL's own arithmetic
(copied from TRL 1.9.1, and used only where TRL's methods are exactly 1.9.1's, by source hash): GRPO's
``importance_sampling_ratio`` of those rows (its truncation or mask), RLOO's ``old_logps``. After the last
micro-batch of the generation batch, TRL's ``sampling/*`` metrics are computed over the whole generation batch in its
original row order, gathered over ranks as TRL gathers them (the same five gathers on every rank, one generation batch
later in the step), and logged once per generation batch: the same values in the same log.

It acts only on the rollouts TRL's training loop makes (``_prepare_inputs``), whose output TRL's shuffle, split and
loss passes consume; a rollout called from anywhere else keeps its pass and a complete output. It steps aside (TRL's
pass runs, one line says why) where that does not hold: misaligned steps or ``num_iterations > 1`` (the weights
change between the passes), GRPO without vLLM or without the correction (TRL runs no such pass), RLOO without vLLM
(not proven there), RLOO with ``beta > 0`` (its KL penalty enters the rewards from the rollout's log-probs, before any
loss pass), Liger's loss (no per-token log-probs), evaluation, and a trainer whose rollout, scoring or loss methods
are not TRL 1.9.1's (TRL >= 1.16 among them, or a subclass that overrides them).

Not measured: the loss pass's peak memory. Where sampling_parity processes a cut (top-k, top-p, min-p), its float32
chunks (up to 67,108,864 elements, 256 MiB) now run inside the loss pass, at its activation peak, not in a
no-gradient pass.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .. import ratio_pass
from ..call_arguments import bind
from ..declaration import VLLM_MODES, Applicability, Fix, on_trainers
from ..log_once import warn_once
from ..logs import fix_logger
from ..owner_state import OwnerState

LOGGER = fix_logger(__name__)
_ROLLOUT = "_generate_and_score_completions"
_LOSS = "_compute_loss"
_SCORING = "_get_per_token_logps_and_entropies"

# sha256 of TRL 1.9.1's methods this fix's arithmetic and its place in the step are proven on (TRL's code, copied
# below, runs where TRL's would): any other source, TRL's or a subclass's, and the fix steps aside
PROVEN_SOURCES: dict[str, dict[str, str]] = {
    "GRPOTrainer": {
        "_prepare_inputs": "f824e7fb07147956",
        _ROLLOUT: "da3b7eb07b6398e7",
        "compute_loss": "4f555f9407fe50c8",
        _LOSS: "9721cd3affc33b37",
        _SCORING: "4af3691399f30834",
    },
    "RLOOTrainer": {
        "_prepare_inputs": "f824e7fb07147956",
        _ROLLOUT: "ff4a6e3f0820deff",
        "compute_loss": "3fc1ac07b5c41d31",
        _LOSS: "c1f9fa0cd5a6948c",
        _SCORING: "f6a06497779df70e",
    },
}


def _trl_kind(cls: type) -> str | None:
    """``GRPOTrainer`` or ``RLOOTrainer``: the TRL class ``cls`` is, or derives from."""
    names = {klass.__name__ for klass in cls.__mro__ if klass.__module__.startswith("trl.")}
    return next((kind for kind in PROVEN_SOURCES if kind in names), None)


def _source_hash(function: Any) -> str:
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return "no source"
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _source_problem(cls: type) -> str | None:
    """Why ``cls``'s methods are not the ones proven, or None; asked again whenever a method is replaced (a subclass,
    a patch after the first trainer: the answer is kept per set of functions, not per class)."""
    kind = _trl_kind(cls)
    if kind is None:
        return f"{cls.__name__} is neither TRL's GRPOTrainer nor its RLOOTrainer"
    functions = tuple((name, inspect.unwrap(getattr(cls, name))) for name in PROVEN_SOURCES[kind])
    return _functions_problem(cls.__name__, kind, functions)


@functools.cache
def _functions_problem(owner: str, kind: str, functions: tuple[tuple[str, Any], ...]) -> str | None:
    changed = [name for name, function in functions if _source_hash(function) != PROVEN_SOURCES[kind][name]]
    if changed:
        return (
            f"{owner}'s {', '.join(changed)} {'is' if len(changed) == 1 else 'are'} not TRL 1.9.1's, where the "
            "loss pass is proven to give the scoring pass's log-probs"
        )
    return None


def _aligned_problem(trainer: Any) -> str | None:
    args = trainer.args
    iterations = int(getattr(trainer, "num_iterations", 1))
    generate_every = int(args.steps_per_generation) * iterations
    if iterations != 1:
        return f"num_iterations={iterations}: the weights change between a rollout and its later loss passes"
    if int(args.gradient_accumulation_steps) % generate_every != 0:
        return (
            f"gradient_accumulation_steps={args.gradient_accumulation_steps} is not a multiple of "
            f"steps_per_generation={args.steps_per_generation}: a generation batch spans an optimizer step"
        )
    return None


# GRPO without vLLM runs no such pass on aligned steps; RLOO's is kept there (the fix is proven with vLLM's rollouts)
_NO_VLLM = "GRPO scores no pass for the importance-sampling ratio when steps are aligned, RLOO keeps its pass"


def _installed_problem() -> str | None:
    """The installed TRL's GRPOTrainer, asked before any trainer exists (``status --model``)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    return _source_problem(GRPOTrainer)


def scope(trainer: Any) -> str | None:
    """Why this trainer keeps TRL's scoring pass, or None where its loss passes give the same log-probs."""
    kind = _trl_kind(type(trainer))
    if not getattr(trainer, "use_vllm", False):
        return f"use_vllm is off: {_NO_VLLM}"
    if kind == "GRPOTrainer":
        if not (trainer.vllm_importance_sampling_correction and trainer.args.vllm_importance_sampling_correction):
            return "vllm_importance_sampling_correction is off: TRL scores no pass for a ratio when steps are aligned"
        if getattr(trainer, "use_liger_kernel", False):
            return "Liger's GRPO loss computes no per-token log-probs to take the old ones from"
    elif kind == "RLOOTrainer" and float(getattr(trainer, "beta", 0.0)) != 0.0:
        return "beta > 0: RLOO's KL penalty enters the rewards from the rollout's log-probs, before any loss pass"
    return _aligned_problem(trainer) or _source_problem(type(trainer))


def _aside_now(trainer: Any) -> str | None:
    if not getattr(getattr(trainer, "model", None), "training", False):
        return "evaluation: each eval batch is scored for its own loss"
    return scope(trainer)


def _step_aside(trainer: Any, reason: str) -> None:
    warn_once(
        ("scoring_skip", type(trainer).__name__, reason),
        "steps aside for %s: %s; TRL's scoring pass runs",
        type(trainer).__name__,
        reason,
        logger=LOGGER,
        level=logging.INFO,
    )


# --- the rollout: no scoring pass -----------------------------------------------------------------------------------


@dataclass
class _Generation:
    """A GRPO generation batch whose trainer log-probs and ratio its loss passes give, row by row."""

    sampling: Any  # vLLM's log-probs, as TRL's ratio and metrics read them (rows x completion positions)
    mask: Any  # TRL's ratio mask: completion_mask, times tool_mask where there is one
    old: Any = None  # the trainer's log-probs, filled by the loss passes in the generation batch's order
    ratio: Any = None  # the ratio TRL's loss got, likewise
    rows_seen: int = 0


_generations: OwnerState[_Generation | None] = OwnerState(lambda: None)
_rloo_skipped: OwnerState[bool] = OwnerState(lambda: False)  # RLOO's rollout in progress made no scoring pass


_in_training_step: ContextVar[bool] = ContextVar("trl_vlm_fixes_scoring_skip_step", default=False)


def prepare_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_prepare_inputs``: the rollouts TRL's training loop makes, whose output its shuffle, split and loss passes
    consume (the proof's path); a rollout called from anywhere else keeps its scoring pass and a complete output."""
    token = _in_training_step.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _in_training_step.reset(token)


def rollout_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_generate_and_score_completions``: TRL's rollout without the no-gradient pass of the trainer's model."""
    if not _in_training_step.get():
        return wrapped(*args, **kwargs)
    if reason := _aside_now(instance):
        _step_aside(instance, reason)
        return wrapped(*args, **kwargs)
    grpo = _trl_kind(type(instance)) == "GRPOTrainer"
    if grpo:  # TRL's own rule then scores no pass, computes no ratio and logs no ratio metrics: the loss passes will
        setting = instance.vllm_importance_sampling_correction
        instance.vllm_importance_sampling_correction = False
    _rloo_skipped.set(instance, False)
    try:
        with ratio_pass.deferred_rollout():
            output = wrapped(*args, **kwargs)
    finally:
        if grpo:
            instance.vllm_importance_sampling_correction = setting
    if not isinstance(output, dict) or not (grpo or _rloo_skipped.get(instance)):
        return output  # RLOO's rollout made no scoring call: its old_logps are TRL's own
    if grpo and output.get("sampling_per_token_logps") is None:
        raise RuntimeError(
            "scoring_skip: vLLM returned no log-probs for this rollout, so TRL's importance-sampling ratio cannot be "
            "computed (TRL itself would fail at its ratio); check the engine's logprobs settings"
        )
    import torch

    rows = output["completion_ids"].size(0)
    output[ratio_pass.ROW_KEY] = torch.arange(rows, device=output["completion_ids"].device)
    if grpo:
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        pending = _generations.get(instance)
        if pending is not None:
            LOGGER.warning(
                "a generation batch's sampling metrics were not logged: %d of its rows reached a loss pass",
                pending.rows_seen,
            )
        _generations.set(instance, _Generation(output["sampling_per_token_logps"], mask))
    return output


def scoring_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_get_per_token_logps_and_entropies``: RLOO's rollout scoring call returns without running the model; in a
    loss pass, the policy's log-probs give the ratio's (GRPO) or the old ones (RLOO)."""
    loss_pass = ratio_pass.current_loss_pass()
    if loss_pass is not None and not loss_pass.scored:
        result = wrapped(*args, **kwargs)
        loss_pass.scored = True
        _from_loss_pass(instance, loss_pass, result[0].detach())
        return result
    if ratio_pass.rollout_deferred() and _trl_kind(type(instance)) == "RLOOTrainer" and not _rloo_skipped.get(instance):
        import torch

        bound = bind(wrapped, args, kwargs)
        if bound.arguments.get("model") is instance.model and not torch.is_grad_enabled():
            # TRL's first call in its rollout: old_per_token_logps, summed into old_logps, which the loss pass sets
            _rloo_skipped.set(instance, True)
            ids = bound.arguments["input_ids"]
            keep = int(bound.arguments["logits_to_keep"])
            return ids.new_zeros((ids.size(0), keep), dtype=torch.float32), None, None
    return wrapped(*args, **kwargs)


# --- the loss passes ------------------------------------------------------------------------------------------------


def loss_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_compute_loss``: a micro-batch of a rollout without its scoring pass gives it in its loss pass."""
    inputs = bind(wrapped, args, kwargs).arguments.get("inputs")
    if not isinstance(inputs, dict) or not ratio_pass.deferred(inputs):
        return wrapped(*args, **kwargs)
    with ratio_pass.loss_pass(inputs) as loss_pass:
        loss = wrapped(*args, **kwargs)
    if not loss_pass.scored:
        raise RuntimeError(
            "scoring_skip: TRL's loss made no pass of the policy model, so this micro-batch got no importance-"
            "sampling ratio; set TRL_VLM_FIXES_SCORING_SKIP=0 (TRL's scoring pass) and report it"
        )
    generation = _generations.get(instance)
    if generation is not None and generation.rows_seen == generation.sampling.size(0):
        _generations.set(instance, None)
        _log_sampling_metrics(instance, generation)
    return loss


def _from_loss_pass(trainer: Any, loss_pass: ratio_pass.LossPass, logps: Any) -> None:
    inputs = loss_pass.inputs
    rows = inputs[ratio_pass.ROW_KEY]
    if _trl_kind(type(trainer)) == "RLOOTrainer":
        inputs["old_logps"] = (logps * inputs["completion_mask"]).sum(1)  # TRL's rollout line, on these rows
        return
    generation = _generations.get(trainer)
    if generation is None:
        raise RuntimeError(
            "scoring_skip: a micro-batch of a rollout without its scoring pass reached the loss, and the rollout's "
            "vLLM log-probs are gone; set TRL_VLM_FIXES_SCORING_SKIP=0 and report it"
        )
    old = loss_pass.ratio_logps if loss_pass.ratio_logps is not None else logps
    ratio = trl_ratio(trainer, old, generation.sampling[rows], generation.mask[rows])
    inputs["importance_sampling_ratio"] = ratio
    if generation.old is None:
        generation.old = old.new_full(generation.sampling.shape, math.nan)
        generation.ratio = ratio.new_full((generation.sampling.size(0), ratio.size(1)), math.nan)
    generation.old[rows] = old
    generation.ratio[rows] = ratio
    generation.rows_seen += rows.numel()


def trl_ratio(trainer: Any, old_per_token_logps: Any, sampling_per_token_logps: Any, mask: Any) -> Any:
    """TRL 1.9.1's importance-sampling ratio (``GRPOTrainer._generate_and_score_completions``), row by row: the same
    statements on these rows."""
    import torch

    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask

    sequence_level_is = trainer.vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff

    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if trainer.vllm_importance_sampling_mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(
            vllm_importance_sampling_ratio,
            min=trainer.vllm_importance_sampling_clip_min,
            max=trainer.vllm_importance_sampling_clip_max,
        )
    elif trainer.vllm_importance_sampling_mode in ["sequence_mask", "token_mask"]:
        min_val = (
            trainer.vllm_importance_sampling_clip_min
            if trainer.vllm_importance_sampling_clip_min is not None
            else -math.inf
        )
        max_val = (
            trainer.vllm_importance_sampling_clip_max
            if trainer.vllm_importance_sampling_clip_max is not None
            else math.inf
        )
        invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (vllm_importance_sampling_ratio > max_val)
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)
    else:
        raise ValueError(
            f"Unknown vLLM importance sampling level: {trainer.vllm_importance_sampling_mode}. Possible values are "
            "'token_truncate', 'token_mask', 'sequence_truncate', and 'sequence_mask'."
        )
    return vllm_importance_sampling_ratio


def _log_sampling_metrics(trainer: Any, generation: _Generation) -> None:
    """TRL 1.9.1's ``sampling/*`` metrics of one generation batch, its statements on the whole batch in its order."""
    import torch
    from trl.trainer.utils import nanmax, nanmin

    device = trainer.accelerator.device
    mode = "train"
    old_per_token_logps, sampling_per_token_logps = generation.old, generation.sampling
    vllm_importance_sampling_ratio = generation.ratio
    sequence_level_is = trainer.vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]

    delta = torch.abs(old_per_token_logps - sampling_per_token_logps)
    mask = generation.mask.bool()
    delta = delta[mask]
    mean_delta = torch.mean(delta) if delta.numel() > 0 else torch.tensor(0.0, device=device)
    max_delta = torch.max(delta) if delta.numel() > 0 else torch.tensor(0.0, device=device)
    trainer._metrics[mode]["sampling/sampling_logp_difference/mean"].append(
        trainer.accelerator.gather(mean_delta).mean().item()
    )
    trainer._metrics[mode]["sampling/sampling_logp_difference/max"].append(
        trainer.accelerator.gather(max_delta).max().item()
    )
    if sequence_level_is:
        flat_is_ratio = vllm_importance_sampling_ratio.flatten()
    else:
        flat_is_ratio = vllm_importance_sampling_ratio[mask]

    min_importance_sampling_ratio = (
        torch.min(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    )
    mean_importance_sampling_ratio = (
        torch.mean(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    )
    max_importance_sampling_ratio = (
        torch.max(flat_is_ratio) if flat_is_ratio.numel() > 0 else torch.tensor(0.0, device=device)
    )
    trainer._metrics[mode]["sampling/importance_sampling_ratio/min"].append(
        nanmin(trainer.accelerator.gather(min_importance_sampling_ratio)).item()
    )
    trainer._metrics[mode]["sampling/importance_sampling_ratio/mean"].append(
        trainer.accelerator.gather(mean_importance_sampling_ratio).nanmean().item()
    )
    trainer._metrics[mode]["sampling/importance_sampling_ratio/max"].append(
        nanmax(trainer.accelerator.gather(max_importance_sampling_ratio)).item()
    )


FIX = Fix(
    name="scoring_skip",
    summary="no no-gradient scoring pass that the loss pass repeats: aligned steps take the old log-probs (and the "
    "importance-sampling ratio) from each micro-batch's loss pass",
    packages=("trl",),
    targets=on_trainers(
        {"_prepare_inputs": prepare_wrapper, _ROLLOUT: rollout_wrapper, _SCORING: scoring_wrapper, _LOSS: loss_wrapper}
    ),
    selftest="trl_vlm_fixes.selftest.checks.scoring_skip:check",
    scope=scope,
    applicability=Applicability(modes=VLLM_MODES, aside={"none": _NO_VLLM}, installed=_installed_problem),
)
