"""vLLM's V2 model runner's sampling kernels on the GPU against the trainer's processed log-prob (sampling_parity).

V2 (vLLM 0.25.1's runner for Qwen3-VL/Qwen2.5-VL, 0.29+'s for every family) applies the temperature, min-p and the
log-softmax with Triton kernels of its own (``vllm/v1/worker/gpu/sample/``). On the CPU the tests run them in Triton's
interpreter, whose arithmetic is numpy's IEEE float32; compiled for a GPU, Triton may use approximate division and
``log``/``exp``. This script runs vLLM's own compiled kernels on CUDA tensors, as a V2 engine step does (float32 copy,
temperature, min-p, top-k/top-p through the function every routed engine step takes, ``compute_token_logprobs`` of the
sampled token), and the trainer's ``processed.VllmSteps`` on the same bf16-grid logits, with V2's steps (the fix: its
min-p rule, its temperature kernel) and V1's (before it). It prints a table and writes JSON (``--out``):

- ``temperature_ulps``: elements where V2's temperature kernel differs from IEEE float32 division (V1's step; max
  ulps), and from the trainer's temperature step where the engine runs V2 (must be 0);
- per setting: the largest and mean |engine - trainer| per token (nats), with V2's steps and V1's; rows whose engine
  log-prob is not finite (must be 0: no row masked away);
- ``boundary``: rows built so that token 1 sits where V1's min-p rule and V2's disagree (found on this device with
  torch's arithmetic): the engine's log-prob of the top token against the trainer's under each runner's steps.

``--dry-run`` runs the same on the CPU, the kernels in Triton's interpreter (a check of the script, not a record).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trl_vlm_fixes.patches.sampling_parity import engine_steps, vllm_rule
from trl_vlm_fixes.patches.sampling_parity.distribution import V1_RUNNER, V2_RUNNER, SamplingDistribution
from trl_vlm_fixes.patches.sampling_parity.processed import VllmSteps
from trl_vlm_fixes.selftest import v2_kernels

SETTINGS: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "min_p": 0.1, "top_k": 50},
    {"temperature": 0.9, "min_p": 0.02, "top_p": 0.95},
    {"temperature": 1.0, "top_k": 20, "top_p": 0.95},
]


def bf16_rows(rows: int, vocabulary: int, seed: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocabulary, generator=generator) * 2.5).to(torch.bfloat16).to(torch.float32).to(device)


def trainer(logits: torch.Tensor, ids: torch.Tensor, distribution: SamplingDistribution) -> torch.Tensor:
    steps = VllmSteps(distribution, logits.size(0), logits.size(1), logits.device)
    return steps.processed(logits.clone(), ids.squeeze(1)).processed


def temperature_ulps(engine: v2_kernels.Engine, logits: torch.Tensor, temperature: float) -> dict[str, Any]:
    """V2's kernel against IEEE division (V1's step) and against the trainer's step where the engine runs V2."""
    kernel = engine.temperature(logits, temperature)
    divided = logits / torch.full((logits.size(0), 1), temperature, device=logits.device)
    trainer_v2 = engine_steps.apply_scalar(logits.clone(), temperature, V2_RUNNER)

    def differing(other: torch.Tensor) -> tuple[int, int]:
        ulps = (kernel.view(torch.int32).long() - other.view(torch.int32).long()).abs()
        return int((ulps > 0).sum()), int(ulps.max())

    (division, division_ulps), (trainer, trainer_ulps) = differing(divided), differing(trainer_v2)
    return {
        "temperature": temperature,
        "elements_differing": division,
        "max_ulps": division_ulps,
        "trainer_elements_differing": trainer,
        "trainer_max_ulps": trainer_ulps,
    }


def measure(rows: int, vocabulary: int, device: torch.device) -> dict[str, Any]:
    engine = v2_kernels.Engine(device)
    logits = bf16_rows(rows, vocabulary, 1, device)
    record: dict[str, Any] = {
        "rows": rows,
        "vocabulary": vocabulary,
        "temperature_ulps": [temperature_ulps(engine, logits, t) for t in (0.7, 0.8, 0.9)],
        "settings": [],
    }
    for index, settings in enumerate(SETTINGS):
        fixed = SamplingDistribution(**settings, runner=V2_RUNNER)
        ids, engine_logps, _ = engine.step(logits, fixed, seed=2 + index)
        row: dict[str, Any] = {"settings": settings, "rows_not_finite": int((~torch.isfinite(engine_logps)).sum())}
        for runner in (V2_RUNNER, V1_RUNNER):
            gap = (engine_logps - trainer(logits, ids, SamplingDistribution(**settings, runner=runner))).abs()
            row[f"{runner}_steps_max"] = float(gap.max())
            row[f"{runner}_steps_mean"] = float(gap.mean())
        record["settings"].append(row)
    min_p, temperature = 0.05, 0.8
    edge = v2_kernels.min_p_boundary_rows(rows, vocabulary, min_p, temperature, device)
    if len(edge):
        top = torch.zeros(len(edge), 1, dtype=torch.long, device=device)
        work = engine.temperature(edge, temperature)
        engine.min_p(work, min_p)
        engine_logps = engine.logprobs(work, top)
        gaps = {}
        for runner in (V2_RUNNER, V1_RUNNER):
            distribution = SamplingDistribution(temperature=temperature, min_p=min_p, runner=runner)
            gaps[f"{runner}_steps_max"] = float((engine_logps - trainer(edge, top, distribution)).abs().max())
        record["boundary"] = {"rows": len(edge), **gaps}
    else:
        record["boundary"] = {"rows": 0}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,64", help="requests per engine step")
    parser.add_argument("--vocabulary", default="151936,248320")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the kernels in Triton's interpreter")
    parser.add_argument("--out", default="v2_sampler_kernels.json")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    rows_list = [8] if args.dry_run else [int(r) for r in args.rows.split(",")]
    vocabularies = [2048] if args.dry_run else [int(v) for v in args.vocabulary.split(",")]
    report: dict[str, Any] = {
        "device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
        "top_k_top_p": vllm_rule.describe(),
        "results": [measure(rows, vocabulary, device) for vocabulary in vocabularies for rows in rows_list],
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{report['device']}; {report['top_k_top_p']}")
    print(f"{'rows':>5} {'vocab':>7} {'settings':<44} {'V2 steps max':>12} {'V1 steps max':>12} {'not finite':>10}")
    for result in report["results"]:
        for row in result["settings"]:
            print(
                f"{result['rows']:>5} {result['vocabulary']:>7} {json.dumps(row['settings']):<44} "
                f"{row['v2_steps_max']:>12.3g} {row['v1_steps_max']:>12.3g} {row['rows_not_finite']:>10}"
            )
        boundary = result["boundary"]
        if boundary["rows"]:
            print(
                f"{result['rows']:>5} {result['vocabulary']:>7} {'min-p boundary rows: ' + str(boundary['rows']):<44} "
                f"{boundary['v2_steps_max']:>12.3g} {boundary['v1_steps_max']:>12.3g}"
            )
        ulps = ", ".join(
            f"T={u['temperature']}: {u['elements_differing']} ({u['max_ulps']} ulp) / {u['trainer_elements_differing']}"
            for u in result["temperature_ulps"]
        )
        print(f"      V2's temperature kernel, elements differing from IEEE division / the trainer's V2 step: {ulps}")


if __name__ == "__main__":
    main()
