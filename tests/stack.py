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
