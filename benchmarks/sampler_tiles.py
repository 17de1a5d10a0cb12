"""Does the tile size change what vLLM's Triton top-k/top-p kernel keeps? (CPU, Triton's interpreter.)

vLLM 0.25.1's ``apply_top_k_top_p_triton`` runs 256/128 tiles on CPU tensors and 8192/4096 on CUDA ones, and its pivot
search starts from one tile's statistics. This runs the kernel's own source in Triton's interpreter with both tile
choices on bf16-grid rows at Qwen3.5's vocabulary and reports (no assertion) how often the kept sets differ, and how
far the processed log-probs of the kept tokens move; vLLM's sort path is shown beside them.

    .venv/bin/python benchmarks/sampler_tiles.py --rows 4 --out /tmp/sampler_tiles.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from trl_vlm_fixes.patches.sampling_parity import kernel_copy

SETTINGS = {"top_p=0.95+top_k=20": (20, 0.95), "top_p=0.95": (None, 0.95), "top_k=20": (20, None)}


def _processed(masked: torch.Tensor) -> torch.Tensor:
    return masked.log_softmax(-1, dtype=torch.float32)


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    kept_a, kept_b = a > float("-inf"), b > float("-inf")
    both = kept_a & kept_b
    shift = (_processed(a) - _processed(b)).where(both, torch.zeros(()))
    return {
        "rows_differing": int((kept_a != kept_b).any(1).sum()),
        "kept_difference_per_row": (kept_a.sum(1) - kept_b.sum(1)).tolist(),
        "max_abs_logprob_shift": float(shift.abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args()
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    cuda_tiles = kernel_copy.interpreted_top_k_top_p(kernel_copy.CUDA_TILES)
    cpu_tiles = kernel_copy.interpreted_top_k_top_p(kernel_copy.CPU_TILES)
    generator = torch.Generator().manual_seed(0)
    rows = (torch.randn(arguments.rows, arguments.vocab, generator=generator) * 3).to(torch.bfloat16).float()
    report: dict[str, Any] = {"rows": arguments.rows, "vocab": arguments.vocab, "settings": {}}
    for name, (top_k, top_p) in SETTINGS.items():
        k = None if top_k is None else torch.full((len(rows),), top_k, dtype=torch.int32)
        p = None if top_p is None else torch.full((len(rows),), top_p)
        started = time.perf_counter()
        cuda = cuda_tiles(rows.clone(), k, p)
        cpu = cpu_tiles(rows.clone(), k, p)
        sort = apply_top_k_top_p_pytorch(rows.clone(), k, p)
        report["settings"][name] = {
            "kept_cuda_tiles": (cuda > float("-inf")).sum(1).tolist(),
            "cpu_tiles_vs_cuda_tiles": _compare(cpu, cuda),
            "sort_vs_cuda_tiles": _compare(sort, cuda),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(name, json.dumps(report["settings"][name]), flush=True)
        arguments.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
