"""``gdn_prefill``'s self-test check: the Gated-DeltaNet prefill kernel the engine TRL builds is asked for."""

from __future__ import annotations

from typing import Any

from ...patches.gdn_prefill import kernel_gone_reason, selected_backend
from ...vllm_arguments import engine_argument_problem
from ..runner import CheckResult, SelftestContext, off_then_on


def check(context: SelftestContext, family: str) -> CheckResult:
    """Which Gated-DeltaNet prefill kernel the engine TRL builds is asked for, where the kernel that hangs exists."""
    from ..rollout_schedule import build_generation

    def measure() -> Any:
        generation = build_generation(context.model_dir(family), context.processor(family))
        return generation.llm.init_kwargs.get("gdn_prefill_backend")

    def bug(backend: Any) -> tuple[bool, str]:
        if gone := kernel_gone_reason():
            return False, f"fix off: gdn_prefill_backend={backend}, no kernel to avoid (installed versions: {gone})"
        return backend is None, (
            f"fix off: gdn_prefill_backend={backend} (vLLM 0.25.1 then picks FlashInfer's SM90 kernel on Hopper)"
        )

    def fix(backend: Any) -> tuple[bool, str]:
        problem = engine_argument_problem("gdn_prefill_backend", backend)
        detail = f"fix on: gdn_prefill_backend={backend}" + (f" ({problem})" if problem else "")
        return backend == selected_backend() and problem is None, detail

    return off_then_on("gdn_prefill", measure, bug, fix)
