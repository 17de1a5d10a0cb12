"""The ``applies`` rules several fixes share: why a fix steps aside for a planned run (``declaration.Plan``).

Each reads what the fix's ``scope`` reads from a built trainer, from the checkpoint's ``config.json`` and the mode
instead, and gives the reason the fix's log line would give. A fix declares its rule in its ``FIX(..., applies=...)``.
"""

from __future__ import annotations

from .declaration import Plan
from .engine_args import NO_GATED_DELTANET
from .model_facts import has_gated_deltanet


def without_vllm(plan: Plan, what: str) -> str | None:
    """``use_vllm`` off: ``what`` says what the fix then has nothing to act on."""
    return f"use_vllm is off: {what}" if plan.mode == "none" else None


def without_colocated_sleep(plan: Plan, what: str) -> str | None:
    """The bugs of sleep mode need TRL's colocated engine with ``vllm_enable_sleep_mode=True``."""
    if plan.mode == "colocate" and plan.sleep_mode:
        return None
    return f"{plan.mode} mode without colocated sleep mode: {what}"


def gated_deltanet_engine(plan: Plan) -> str | None:
    """``cudagraph`` and ``gdn_prefill`` (``engine_args.gated_deltanet_scope``): a vLLM engine serving
    Gated-DeltaNet layers (in server mode: the engine of ``trl vllm-serve`` under ``trl-vlm-fixes run``)."""
    if reason := without_vllm(plan, "no vLLM engine"):
        return reason
    return None if has_gated_deltanet(plan.config) else f"the served model {NO_GATED_DELTANET}"


def vllm_logprobs_compared(plan: Plan) -> str | None:
    """``sampling_parity``: TRL compares vLLM's log-probs with the trainer's (``GRPOConfig``'s default
    ``vllm_importance_sampling_correction=True``) only where vLLM samples."""
    return without_vllm(plan, "TRL samples with transformers and compares no vLLM log-probs")


def watched_calls(plan: Plan) -> str | None:
    """``watchdog``: it watches vLLM's engine and server calls; without vLLM there are none."""
    return without_vllm(plan, "no vLLM engine or server call to watch")
