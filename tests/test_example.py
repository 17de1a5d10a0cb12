"""The example is the main job: it trains the mixed image batch, alone and (with LoRA) under accelerate with 2 CPU
processes.

Two trainings, not three: LoRA runs under accelerate's two ranks (one run proves the example's ``--lora`` and its
multi-rank path; they used to be two runs). The full-parameter model on two ranks is trained in
tests/test_reload_skip.py (``test_uneven_tool_turns_across_ranks_finish_on_current_weights``: GRPOTrainer under
torchrun, 2 CPU processes) and here alone in one process.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

from helpers import accelerate_two_cpu_ranks, environment_without_switches

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_qwen35_vlm.py"


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = environment_without_switches()
    env["MASTER_PORT"] = _free_port()  # tests run in parallel: never share torch.distributed's default port
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def test_example_trains_a_mixed_image_batch() -> None:
    result = _run([sys.executable, str(EXAMPLE), "--steps", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 steps on a mixed image batch" in result.stdout
    assert re.search(r"mm_realign\s+applied", result.stderr)
    assert "'trl_vlm_fixes/mm_realigned_rows'" in result.stdout


def test_example_with_lora_under_accelerate_with_two_processes() -> None:
    result = _run([*accelerate_two_cpu_ranks(_free_port()), str(EXAMPLE), "--lora"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 2 steps on a mixed image batch" in result.stdout  # rank 0's line (LoRA: was its own run)
    for rank in (0, 1):
        assert f"rank {rank} of 2, fix status" in result.stderr
        assert re.search(rf"rank {rank} finished 2 steps with fixes mm_realign=applied", result.stderr)
