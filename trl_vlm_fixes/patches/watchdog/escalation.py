"""What a watchdog exit leaves for the next engine in its ``output_dir``: the hang, recorded in the protection state
(``protection.record_hang``) before the report is written, and the report's lines saying so.

An engine without progress (the engine-step rule, or the total-time rule of an engine without a step to watch) raises
the level one step; any other hang (a weight push, a sleep or wake-up, a server generate) is recorded and leaves the
level as it was. No process of a server reads the trainer's ``output_dir``: on a server generate the report names the
flag that gives the server's engine the same protection. This module imports nothing of the watchdog's (the report
writer imports it).
"""

from __future__ import annotations

from typing import Any

from ... import protection

ENGINE_WATCHES = ("engine-step", "engine_generate")  # the rules that fire on a colocated engine without progress
SERVER_GENERATE = "server_generate"


def record(watch: str, step: Any, rank: int, output_dir: str | None) -> list[str]:
    """Record this hang in ``output_dir``'s protection state; the report's lines about it (raises where it cannot be
    written: the report then says the restart is not protected)."""
    if output_dir is None:
        return ["protection: no trainer's output_dir is known here: nothing recorded."]
    engine = watch in ENGINE_WATCHES
    level = protection.record_hang(output_dir, step, watch, rank, engine)
    path = protection.state_path(output_dir)
    if engine:
        lines = [
            f"protection: engine hang recorded in {path}: the next engine in this output_dir is built with "
            f"{level.name} ({protection.protected_settings(level)}) where the engine fixes act (a model with "
            "Gated-DeltaNet layers)."
        ]
    else:
        lines = [f"protection: this {watch} hang is recorded in {path} and leaves the level as it was ({level.name})."]
    return lines + _server_note(watch, output_dir)


def not_recorded(why: str) -> list[str]:
    return [
        f"protection: NOT recorded ({why}): the restart here is not protected; to protect it, pin "
        "TRL_VLM_FIXES_CUDAGRAPH_MODE=PIECEWISE (NONE after a second engine hang)."
    ]


def _server_note(watch: str, output_dir: str) -> list[str]:
    """On a server generate that never returned: the flag that gives the server's engine the protection (``NONE``
    from the second such hang recorded here)."""
    if watch != SERVER_GENERATE:
        return []
    try:
        _, hangs = protection.read_state(output_dir)
    except protection.StateError:
        hangs = []
    mode = "NONE" if sum(hang.get("kind") == SERVER_GENERATE for hang in hangs) > 1 else "PIECEWISE"
    from ...engine_args import server_builds_elsewhere

    if server_builds_elsewhere():  # TRL >= 1.11: vLLM's own server, its own flags
        flag = f'`trl vllm-serve ... --compilation-config \'{{"cudagraph_mode": "{mode}"}}\'`'
    else:
        flag = f"`TRL_VLM_FIXES_CUDAGRAPH_MODE={mode} trl-vlm-fixes run -- trl vllm-serve ...`"
    return [
        f"server: if the server's engine is wedged (its log stopped, its GPU busy) and it serves a model with "
        f"Gated-DeltaNet layers (Qwen3.5), restart it with {flag}: no process of the server reads this output_dir."
    ]
