"""``expert_layout``'s self-test check: the MoE backend the engine TRL builds gets on this machine."""

from __future__ import annotations

from typing import Any

from ...moe_backend import has_routed_experts, rearranging_moe_backend
from ...patches.expert_layout import kept_layout
from ..runner import CheckResult, SelftestContext, off_then_on


def check(context: SelftestContext, family: str) -> CheckResult:
    """The MoE backend the engine TRL builds gets on this machine, where vLLM's default would rearrange the experts."""
    from ..rollout_schedule import build_generation

    def measure() -> tuple[Any, Any]:
        generation = build_generation(context.model_dir(family), context.processor(family))
        return generation.model.config, generation.llm.init_kwargs.get("moe_backend")

    def bug(measured: tuple[Any, Any]) -> tuple[bool | None, str]:
        config, backend = measured
        if not has_routed_experts(config):
            return None, f"fix off: no routed experts ({family})"
        if (kept := kept_layout({}, config)) is not None:
            return False, f"fix off: moe_backend={backend}; {kept}"
        return backend is None, f"fix off: moe_backend={backend} ({rearranging_moe_backend({}, config)})"

    def fix(measured: tuple[Any, Any]) -> tuple[bool | None, str]:
        config, backend = measured
        if not has_routed_experts(config):
            return None, "fix on: nothing to do"
        expected = "triton" if kept_layout({}, config) is None else None
        return backend == expected, f"fix on: moe_backend={backend}"

    return off_then_on("expert_layout", measure, bug, fix)
