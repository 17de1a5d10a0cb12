"""The status report: one dict (the CLI's --json) and its table rendering."""

from __future__ import annotations

from typing import Any

from .versions import VALIDATED, installed_versions


def build_status(registry: Any, version: str, activation: str = "import") -> dict[str, Any]:
    patches = {}
    for name, fix in registry.fixes.items():
        state, detail = registry.fix_state(name)
        patches[name] = {"state": state, "detail": detail, "switch": fix.switch, "summary": fix.summary}
    return {
        "version": version,
        "activation": activation,
        "versions": installed_versions(),
        "validated": dict(VALIDATED),
        "patches": patches,
    }


def render_table(status: dict[str, Any]) -> str:
    versions = status["versions"]
    lines = [
        f"trl_vlm_fixes {status['version']} (activated by {status.get('activation', 'import')})",
        "installed: " + ", ".join(f"{name} {versions[name] or '-'}" for name in versions),
        "validated: " + ", ".join(f"{name} {value}" for name, value in status["validated"].items()),
        "",
        f"{'fix':<18} {'state':<13} {'switch':<37} detail",
    ]
    for name, patch in status["patches"].items():
        lines.append(f"{name:<18} {patch['state']:<13} {patch['switch'] + '=0 to turn off':<37} {patch['detail']}")
    return "\n".join(lines)


def render_applicability(report: dict[str, Any]) -> str:
    """``status --model``: one line per fix, its verdict for that checkpoint and mode, and the reason."""
    layers = report["layers"]
    facts = ", ".join(
        [
            "Gated-DeltaNet layers" if layers["gated_deltanet"] else "no Gated-DeltaNet layers",
            "routed experts" if layers["routed_experts"] else "no routed experts",
            f"{layers['deepstack_levels']} deepstack levels" if layers["deepstack_levels"] else "no deepstack",
        ]
    )
    sleep = " with sleep mode" if report["sleep_mode"] else ""
    mode = "no vLLM (use_vllm off)" if report["mode"] == "none" else f"vLLM {report['mode']} mode{sleep}"
    lines = [
        f"{report['model']}: model type {report['model_type']!r} ({facts}); {mode}",
        "",
        f"{'fix':<18} {'verdict':<12} reason",
    ]
    for name, fix in report["fixes"].items():
        lines.append(f"{name:<18} {fix['verdict']:<12} {fix['reason']}")
    lines.extend(f"note: {note}" for note in report["notes"])
    return "\n".join(lines)
