"""Counters are rank-local but only rank 0 reports: the log carries the sum over ranks (2 real processes, gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import counters, environment_without_switches

from conftest import free_port


def run_metrics_ranks(tmp_path: Path) -> list[Any]:
    program = Path(__file__).parent / "programs" / "metrics_ranks.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    result = subprocess.run(
        [*command, str(program), str(tmp_path)],
        env=environment_without_switches(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_each_log_reports_the_sum_over_ranks(tmp_path: Path) -> None:
    """Rank 0 counted 3 realigned rows and 1 re-push, rank 1 5 rows and 2 masked rows, then only rank 1 counted
    (a 0 and 4 re-pushes): rank 0's logs show the sums, a counter only the other rank counted included. A mean (the
    kept share: 10 tokens at 0.9 on rank 0, 30 at 0.5 on rank 1) is the mean over every rank's tokens."""
    rank0, rank1 = run_metrics_ranks(tmp_path)
    first = {
        counters.MM_REALIGNED_ROWS.name: [8.0],
        counters.WEIGHT_REPUSHES.name: [1.0],
        counters.VISION_TOKEN_ROWS_MASKED.name: [2.0],
        counters.SAMPLING_KEPT_MASS.name: [pytest.approx((9.0 + 15.0) / 40)],
    }
    second = {counters.PROMPT_MISMATCH_ROWS.name: [0.0], counters.WEIGHT_REPUSHES.name: [4.0]}
    assert rank0 == [first, second]
    assert rank1 == rank0  # every rank holds the same sums (all-reduce), whichever one reports
