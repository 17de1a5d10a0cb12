"""``wake_reset``'s self-test check: TRL's generate after level-2 wakes that hand out NaN pages."""

from __future__ import annotations

from pathlib import Path

from ..runner import CheckResult, SelftestContext, off_then_on


def check(context: SelftestContext, family: str) -> CheckResult:
    """vLLM's real Qwen3-VL class (the deepstack sibling of ``family``) as TRL's colocated engine on the CPU: after
    level-2 sleeps whose wakes hand out NaN pages, does TRL's generate run on a fresh model's logits?"""
    from ...registry import active
    from ..vllm_engine import DEEPSTACK_SIBLING, VllmModelUnavailable, WakeCheck, release

    sibling = DEEPSTACK_SIBLING.get(family, family)
    layout = _push_fails(context.model_dir(sibling))
    if layout:  # TRL's push itself fails there (expert_layout warns): no wake to check
        return CheckResult(active().fix_state("wake_reset")[0], None, None, 0.0, f"{sibling}: {layout}")
    check = WakeCheck(context.model_dir(sibling), context.processor(sibling), label=sibling)
    try:
        return off_then_on("wake_reset", check.measure, check.judge_bug, check.judge_fix)
    except VllmModelUnavailable as error:
        return CheckResult(active().fix_state("wake_reset")[0], None, None, 0.0, f"{sibling}: {error}")
    finally:
        release()  # vLLM's world of one rank: a dense and a MoE model need different ones


def _push_fails(model_dir: Path) -> str | None:
    from transformers import AutoConfig

    from ...moe_backend import fused_expert_layout_problem

    return fused_expert_layout_problem(AutoConfig.from_pretrained(model_dir))
