"""vLLM's V2 model runner's sampling kernels on the GPU against the trainer's processed log-prob (sampling_parity).

V2 (vLLM 0.25.1's runner for Qwen3-VL/Qwen2.5-VL, 0.29+'s for every family) applies the temperature, min-p and the
log-softmax with Triton kernels of its own (``vllm/v1/worker/gpu/sample/``). On the CPU the tests run them in Triton's
interpreter, whose arithmetic is numpy's IEEE float32; compiled for a GPU, Triton may use approximate division and
``log``/``exp``. This script runs vLLM's own compiled kernels on CUDA tensors, as a V2 engine step does (float32 copy,
temperature, min-p, top-k/top-p through the function every routed engine step takes, ``compute_token_logprobs`` of the
sampled token), and the trainer's ``processed.VllmSteps`` on the same bf16-grid logits, with V2's min-p rule (the fix)
and V1's (before it). It prints a table and writes JSON (``--out``):

- ``temperature_ulps``: elements where V2's temperature kernel differs from torch's float32 division (max ulps);
- per setting: the largest and mean |engine - trainer| per token (nats), with each min-p rule; rows whose engine
  log-prob is not finite (must be 0: no row masked away);
- ``boundary``: rows built so that token 1 sits where V1's min-p rule and V2's disagree (found on this device with
  torch's arithmetic): the engine's log-prob of the top token against the trainer's under each rule.

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

from trl_vlm_fixes.patches.sampling_parity import kernel_copy, vllm_rule
from trl_vlm_fixes.patches.sampling_parity.distribution import (
    LOGIT_MIN_P,
    PROBABILITY_MIN_P,
    SamplingDistribution,
)
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


class Engine:
    """One V2 engine step's arithmetic: vLLM's kernels (compiled on a GPU, interpreted on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        self.kernels = v2_kernels.kernels(self.on_gpu)

    def _run(self, function: Any, *args: Any) -> Any:
        if self.on_gpu:
            return function(*args)
        with kernel_copy.interpreting():
            return function(*args)

    def temperature(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        work = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        if temperature not in (0.0, 1.0):  # SamplingStates.apply_temperature skips the kernel then
            mapping = torch.arange(logits.size(0), dtype=torch.int32, device=logits.device)
            temperatures = torch.full((logits.size(0),), temperature, device=logits.device)
            self._run(self.kernels.apply_temperature, work, mapping, temperatures)
        return work

    def step(self, logits: torch.Tensor, distribution: SamplingDistribution, seed: int) -> tuple[Any, Any]:
        rows = logits.size(0)
        work = self.temperature(logits, distribution.temperature)
        if distribution.min_p > 0.0:
            mapping = torch.arange(rows, dtype=torch.int32, device=logits.device)
            self._run(
                self.kernels.apply_min_p, work, mapping, torch.full((rows,), distribution.min_p, device=work.device)
            )
        k = (
            torch.full((rows,), distribution.top_k, dtype=torch.int32, device=work.device)
            if distribution.top_k
            else None
        )
        p = torch.full((rows,), distribution.top_p, device=work.device) if distribution.top_p < 1.0 else None
        work = vllm_rule.top_k_top_p(work, k, p)
        generator = torch.Generator(device=work.device).manual_seed(seed)
        ids = torch.multinomial(torch.softmax(work, dim=-1), 1, generator=generator)
        return ids, self.logprobs(work, ids)

    def logprobs(self, work: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self._run(self.kernels.compute_token_logprobs, work, ids).squeeze(1)


def trainer(logits: torch.Tensor, ids: torch.Tensor, distribution: SamplingDistribution) -> torch.Tensor:
    steps = VllmSteps(distribution, logits.size(0), logits.size(1), logits.device)
    return steps.processed(logits.clone(), ids.squeeze(1)).processed


def temperature_ulps(engine: Engine, logits: torch.Tensor, temperature: float) -> dict[str, Any]:
    kernel = engine.temperature(logits, temperature)
    reference = logits / temperature
    ulps = (kernel.view(torch.int32).long() - reference.view(torch.int32).long()).abs()
    return {"temperature": temperature, "elements_differing": int((ulps > 0).sum()), "max_ulps": int(ulps.max())}


def measure(rows: int, vocabulary: int, device: torch.device) -> dict[str, Any]:
    engine = Engine(device)
    logits = bf16_rows(rows, vocabulary, 1, device)
    record: dict[str, Any] = {
        "rows": rows,
        "vocabulary": vocabulary,
        "temperature_ulps": [temperature_ulps(engine, logits, t) for t in (0.7, 0.8, 0.9)],
        "settings": [],
    }
    for index, settings in enumerate(SETTINGS):
        fixed = SamplingDistribution(**settings, min_p_rule=LOGIT_MIN_P)
        ids, engine_logps = engine.step(logits, fixed, seed=2 + index)
        row: dict[str, Any] = {"settings": settings, "rows_not_finite": int((~torch.isfinite(engine_logps)).sum())}
        for rule in (LOGIT_MIN_P, PROBABILITY_MIN_P):
            gap = (engine_logps - trainer(logits, ids, SamplingDistribution(**settings, min_p_rule=rule))).abs()
            row[f"{rule}_rule_max"] = float(gap.max())
            row[f"{rule}_rule_mean"] = float(gap.mean())
        record["settings"].append(row)
    min_p, temperature = 0.05, 0.8
    edge = v2_kernels.min_p_boundary_rows(rows, vocabulary, min_p, temperature, device)
    if len(edge):
        top = torch.zeros(len(edge), 1, dtype=torch.long, device=device)
        work = engine.temperature(edge, temperature)
        mapping = torch.arange(len(edge), dtype=torch.int32, device=device)
        engine._run(engine.kernels.apply_min_p, work, mapping, torch.full((len(edge),), min_p, device=device))
        engine_logps = engine.logprobs(work, top)
        gaps = {}
        for rule in (LOGIT_MIN_P, PROBABILITY_MIN_P):
            distribution = SamplingDistribution(temperature=temperature, min_p=min_p, min_p_rule=rule)
            gaps[f"{rule}_rule_max"] = float((engine_logps - trainer(edge, top, distribution)).abs().max())
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
    print(f"{'rows':>5} {'vocab':>7} {'settings':<44} {'V2 rule max':>12} {'V1 rule max':>12} {'not finite':>10}")
    for result in report["results"]:
        for row in result["settings"]:
            print(
                f"{result['rows']:>5} {result['vocabulary']:>7} {json.dumps(row['settings']):<44} "
                f"{row['logit_rule_max']:>12.3g} {row['probability_rule_max']:>12.3g} {row['rows_not_finite']:>10}"
            )
        boundary = result["boundary"]
        if boundary["rows"]:
            print(
                f"{result['rows']:>5} {result['vocabulary']:>7} {'min-p boundary rows: ' + str(boundary['rows']):<44} "
                f"{boundary['logit_rule_max']:>12.3g} {boundary['probability_rule_max']:>12.3g}"
            )
        ulps = ", ".join(
            f"T={u['temperature']}: {u['elements_differing']} ({u['max_ulps']} ulp)" for u in result["temperature_ulps"]
        )
        print(f"      temperature kernel vs torch division, elements differing: {ulps}")


if __name__ == "__main__":
    main()
