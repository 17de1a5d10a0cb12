"""Facts about the installed TRL that decide which bugs exist here (read from its source, as the fixes do)."""

from __future__ import annotations

import functools
import inspect


@functools.cache
def upstream_reloads_from_disk() -> bool:
    """True on TRL 1.9.1 (the reload bug exists); False on TRL >= 1.16, which re-pushes itself (the fix steps aside)."""
    from trl.generation.vllm_generation import VLLMGeneration

    return 'collective_rpc("reload_weights")' in inspect.getsource(VLLMGeneration.generate)


def expected_reload_skip_state() -> str:
    return "applied" if upstream_reloads_from_disk() else "not-needed"


def expected_states() -> dict[str, str]:
    """Every fix's state once TRL is imported, with default switches, on this TRL."""
    return {
        "mm_realign": "applied",
        "reload_skip": expected_reload_skip_state(),
        "cudagraph": "applied",
        "gdn_prefill": "applied",
        "vision_token_guard": "applied",
        "watchdog": "applied",
    }


@functools.cache
def upstream_suppresses_image_token() -> bool:
    """TRL >= 1.16 suppresses the image pad token in its transformers generate path itself (only that token)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    return "suppress_tokens" in inspect.getsource(GRPOTrainer.__init__)


@functools.cache
def server_builds_engine_in_llm_worker() -> bool:
    """TRL 1.9.1's `trl vllm-serve` builds its engine in `llm_worker`, where the engine fixes reach it."""
    import trl.scripts.vllm_serve as vllm_serve

    return hasattr(vllm_serve, "llm_worker")
