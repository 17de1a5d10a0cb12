"""Which fixes will act for a checkpoint and a mode, and why the others step aside: asked before a long run.

``trl-vlm-fixes status --model PATH --mode colocate|server|none`` and ``trl_vlm_fixes.applicability(...)``. The
verdicts come from the fixes' own declarations (``Fix.applies``, the same question as their ``scope`` asked of a plan:
the checkpoint's ``config.json`` and the mode, derived from the data each declares in ``Fix.applicability``: its
families, modes, sleep mode, with the reason of each exclusion), never from a table kept here; a fix the installed
stack turns off, cannot wrap or no longer needs (its state in ``status``) steps aside with that state's reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .declaration import Fix, Plan
from .model_facts import deepstack_levels, has_gated_deltanet, has_routed_experts, read_config
from .moe_backend import fused_expert_layout_problem
from .registry import active

WILL_ACT = "will act"
STEPS_ASIDE = "steps aside"
# the states that decide the verdict before the plan does (the installed stack, the switches)
_STATE_DECIDES = ("disabled", "skipped", "not-needed")
SERVER_NOTE = (
    "server mode: the trainer-side fixes act in the trainer; the engine fixes act in the server's process when it is "
    "started as `trl-vlm-fixes run -- trl vllm-serve ...` (TRL >= 1.11: pass the flags docs/launcher.md lists)"
)
PENDING_NOTE = (
    "TRL is not imported in this process, so whether the installed TRL/vLLM still have each bug was not checked: "
    "`trl-vlm-fixes status --model` checks it"
)


def verdict(fix: Fix, plan: Plan, state: str = "pending", detail: str = "") -> dict[str, str]:
    """One fix's verdict for ``plan``: ``will act`` with what it does, or ``steps aside`` with the reason it logs."""
    if state in _STATE_DECIDES:
        return {"verdict": STEPS_ASIDE, "reason": f"{state}: {detail}"}
    try:
        reason = fix.applies(plan)
    except Exception as error:  # noqa: BLE001 - a report never crashes; it says what it could not read
        reason = f"its applicability could not be read ({error!r})"
    return {"verdict": STEPS_ASIDE, "reason": reason} if reason else {"verdict": WILL_ACT, "reason": fix.summary}


def model_layers(config: Mapping[str, Any]) -> dict[str, Any]:
    """The facts of the checkpoint the engine fixes decide on."""
    return {
        "gated_deltanet": has_gated_deltanet(config),
        "routed_experts": has_routed_experts(config),
        "deepstack_levels": deepstack_levels(config),
    }


def applicability(
    model: str | Path | Mapping[str, Any], mode: str = "colocate", sleep_mode: bool = False, registry: Any = None
) -> dict[str, Any]:
    """For checkpoint ``model`` (a folder, a ``config.json``, a Hub id already in the local cache, or the config as a
    dict) trained in ``mode`` (``colocate``, ``server``, ``none``: no vLLM), each fix's verdict and reason."""
    if registry is None:
        registry = active()
    config = dict(model) if isinstance(model, Mapping) else read_config(model)
    plan = Plan(config, mode, sleep_mode)
    fixes: dict[str, dict[str, str]] = {}
    pending = False
    for name, fix in registry.fixes.items():
        state, detail = registry.fix_state(name)
        pending = pending or state == "pending"
        fixes[name] = {**verdict(fix, plan, state, detail), "switch": fix.switch}
    notes = []
    if mode == "server":
        notes.append(SERVER_NOTE)
    if mode != "none" and (push := fused_expert_layout_problem(config)):
        notes.append(f"TRL's weight push into the engine will fail: {push}")
    if pending:
        notes.append(PENDING_NOTE)
    return {
        "model": "(config)" if isinstance(model, Mapping) else str(model),
        "model_type": config.get("model_type"),
        "layers": model_layers(config),
        "mode": mode,
        "sleep_mode": sleep_mode,
        "fixes": fixes,
        "notes": notes,
    }
