"""The GPU end-to-end script's own logic, dry-run on the CPU with the stand-in engine (the GPU run is in docs/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers import environment_without_switches, upstream_reloads_from_disk

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "grpo_end_to_end.py"


def _stale(rollouts: list[dict[str, Any]]) -> int:
    return sum(r["on_original"] and r["trainer_moved_from_original"] for r in rollouts)


def test_grpo_end_to_end_script_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "grpo.json"
    env = environment_without_switches()
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[2]), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        str(SCRIPT),
        "--stand-in",
        "--steps",
        "2",
        "--variants",
        "on,reload_skip_off,off,prompt_parity_off",
        "--hidden",
        "64",  # the script's logic, not a size: the stand-in decodes with the model on the CPU
    ]
    result = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    variants = json.loads(out.read_text())["variants"]
    on, reload_off, off = variants["on"], variants["reload_skip_off"], variants["off"]
    parity_off = variants["prompt_parity_off"]

    assert on["trained"] and on["weights_trained"] and len(on["rollouts"]) == 4  # 2 rollouts per optimizer step
    assert all(r["trainer_moved_from_original"] for r in on["rollouts"] if r["global_step"] > 0)
    assert all(r["on_current"] for r in on["rollouts"]) and on["disk_reloads"] == 0
    assert on["engine_cudagraph_mode"] == "PIECEWISE"
    # vLLM's own processor behind the stand-in: every row identical with prompt_parity, rows of N > 1 pads not without
    assert all(r["identical_rows"] == r["rows"] for r in on["prompt_parity"]) and len(on["prompt_parity"]) == 4
    doubled = [t != e for r in parity_off["prompt_parity"] for t, e in r["image_pads_trainer_vs_engine"]]
    assert any(doubled) and sum(r["identical_rows"] for r in parity_off["prompt_parity"]) < 4 * 8

    assert reload_off["trained"] and len(reload_off["rollouts"]) == 4
    if upstream_reloads_from_disk():  # TRL 1.9.1: the reload puts the checkpoint back over the synced weights
        assert _stale(reload_off["rollouts"]) == 2 and reload_off["disk_reloads"] == 4
    else:
        assert _stale(reload_off["rollouts"]) == 0

    # upstream the step crashes: the mixed batch (mm_realign) or a sampled placeholder (vision_token_guard), whichever
    # the random policy reaches first
    assert not off["trained"] and ("shape mismatch" in off["error"] or "do not match" in off["error"]), off["error"]
    assert off["engine_cudagraph_mode"] == "default"
    assert "on current" in result.stdout  # the table is printed
