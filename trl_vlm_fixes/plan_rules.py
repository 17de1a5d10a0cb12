"""The ``Applicability`` several fixes share, and the parts of the ``applies`` rules that read a checkpoint's config.

Each reads what the fix's ``scope`` reads from a built trainer, from the checkpoint's ``config.json`` and the mode
instead, and gives the reason the fix's log line would give. A fix declares its applicability in its
``FIX(..., applicability=...)``; ``Fix.applies`` is derived from it.
"""

from __future__ import annotations

from .declaration import VLLM_MODES, Applicability, Plan, VersionBound
from .engine_args import NO_GATED_DELTANET
from .model_facts import has_gated_deltanet


def served_gated_deltanet(plan: Plan) -> str | None:
    """The served model has Gated-DeltaNet layers (``engine_args.gated_deltanet_scope``: the engine's ``acts_on``)."""
    return None if has_gated_deltanet(plan.config) else f"the served model {NO_GATED_DELTANET}"


def gated_deltanet_engine(*versions: VersionBound) -> Applicability:
    """``cudagraph`` and ``gdn_prefill``: a vLLM engine serving Gated-DeltaNet layers (in server mode: the engine of
    ``trl vllm-serve`` under ``trl-vlm-fixes run``), where ``versions`` (if any) say the bug exists."""
    return Applicability(
        modes=VLLM_MODES,
        aside={"none": "no vLLM engine"},
        families=("qwen3_5", "qwen3_5_moe"),
        versions=versions,
        checkpoint=served_gated_deltanet,
    )
