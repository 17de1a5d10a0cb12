"""sampling_parity's one-pass float32 log-prob kernel (``fused_logprob``) on the GPU against the torch path it replaces.

Where nothing is cut (a ban at most) the fix's log-prob of each scored token is vLLM's float32 log-softmax of TRL's
logits at the sampling temperature. The torch path (a float32 copy, the engine's temperature step, ``log_softmax``,
a gather; with a ban, gathers, a subtraction and full rows where the ban holds most of the mass) is the reference:
it is vLLM's own arithmetic. This script scores the same bf16 logits (a trained model's spread, ~2.5 nats; tokens
sampled from them; a ban of 8 placeholder ids, one of them made dominant in some positions and sampled in others)
both ways through ``processed.Scorer`` and writes per setting: the largest and the mean |difference| per token, the
mean signed difference (a bias would add up over a completion), the largest |sum| of the differences over one
completion (the log of the IS weight's error at that length: must stay below 1e-4), and the milliseconds of each path
in one run. ``--dry-run``: the CPU, the kernel in Triton's interpreter, small shapes (a check of the script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trl_vlm_fixes.patches.sampling_parity import fused_logprob, processed
from trl_vlm_fixes.patches.sampling_parity.distribution import V1_RUNNER, V2_RUNNER, SamplingDistribution

SETTINGS: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 0.7, "runner": V2_RUNNER},
    {"temperature": 1.0, "banned": "placeholders"},
    {"temperature": 0.8, "banned": "placeholders", "runner": V2_RUNNER},
]


def logits_and_ids(rows: int, width: int, vocabulary: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits [rows, width, vocabulary] and tokens sampled from them; a placeholder (the last id) made the top
    token in every 16th position, so the ban holds most of the mass there."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, width, vocabulary, generator=generator, device=device, dtype=torch.bfloat16) * 2.5
    logits[:, ::16, vocabulary - 1] = 30.0
    ids = torch.empty(rows * width, dtype=torch.long, device=device)
    flat = logits.view(-1, vocabulary)
    for start in range(0, flat.size(0), 256):
        probs = torch.softmax(flat[start : start + 256].float(), dim=-1)
        ids[start : start + 256] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return logits, ids


def score(logits: torch.Tensor, ids: torch.Tensor, distribution: SamplingDistribution, fused: bool) -> Any:
    positions = processed.Positions(logits[:, :, :1].float(), None, logits, [logits.size(1)] * logits.size(0))
    scorer = processed.Scorer(distribution, distribution.temperature)
    original = fused_logprob.kernel
    if not fused:
        fused_logprob.kernel = lambda _logits: None  # type: ignore[assignment]
    try:
        return scorer.score(positions, ids)
    finally:
        fused_logprob.kernel = original  # type: ignore[assignment]


def timed(function: Any, device: torch.device) -> tuple[Any, float]:
    function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        result = function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, (time.perf_counter() - start) / 3


def measure(rows: int, width: int, vocabulary: int, device: torch.device) -> dict[str, Any]:
    logits, ids = logits_and_ids(rows, width, vocabulary, device)
    placeholders = tuple(range(vocabulary - 8, vocabulary))
    ids[1::16] = vocabulary - 2  # a banned token sampled: always kept
    trl = torch.zeros(rows * width, device=device)
    record: dict[str, Any] = {"rows": rows, "width": width, "vocabulary": vocabulary, "settings": []}
    for settings in SETTINGS:
        fields = dict(settings)
        fields["banned"] = placeholders if fields.get("banned") else ()
        fields.setdefault("runner", V1_RUNNER)
        distribution = SamplingDistribution(**fields)
        (reference, torch_seconds) = timed(lambda d=distribution: score(logits, ids, d, False).finish(trl), device)
        (fused, fused_seconds) = timed(lambda d=distribution: score(logits, ids, d, True).finish(trl), device)
        row: dict[str, Any] = {"settings": settings, "torch_ms": torch_seconds * 1e3, "fused_ms": fused_seconds * 1e3}
        for name, ours, theirs in (("log_prob", fused[0], reference[0]), ("log_kept", fused[1], reference[1])):
            gap = (ours - theirs).view(rows, width).double()
            row[f"{name}_finite"] = bool(torch.isfinite(ours).all() and torch.isfinite(theirs).all())
            row[f"{name}_max"] = float(gap.abs().max())
            row[f"{name}_mean"] = float(gap.abs().mean())
            row[f"{name}_bias"] = float(gap.mean())
            row[f"{name}_completion_sum_max"] = float(gap.sum(dim=1).abs().max())
        record["settings"].append(row)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048, help="scored positions per completion")
    parser.add_argument("--vocabulary", default="151936,248320")
    parser.add_argument("--dry-run", action="store_true", help="CPU, the kernel in Triton's interpreter")
    parser.add_argument("--out", default="fused_logprob.json")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    shapes = [(2, 64, 2048)] if args.dry_run else [(args.rows, args.width, int(v)) for v in args.vocabulary.split(",")]
    if args.dry_run:
        from trl_vlm_fixes.selftest.fused_kernel import InterpretedKernel

        interpreted = InterpretedKernel()
        fused_logprob.kernel = lambda _logits: interpreted  # type: ignore[assignment]
    report: dict[str, Any] = {
        "device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
        "results": [measure(rows, width, vocabulary, device) for rows, width, vocabulary in shapes],
    }
    # the scorer judges the kernel once against the torch path: refused, the "fused" figures would be the torch path's
    report["kernel_trusted"] = fused_logprob.verdict.trusted
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{report['device']}; the kernel trusted by the scorer's first-call check: {report['kernel_trusted']}")
    print(f"{'shape':>18} {'settings':<62} {'max':>9} {'bias':>9} {'sum max':>9} {'torch ms':>9} {'fused ms':>9}")
    for result in report["results"]:
        shape = f"{result['rows']}x{result['width']}x{result['vocabulary']}"
        for row in result["settings"]:
            print(
                f"{shape:>18} {json.dumps(row['settings']):<62} {row['log_prob_max']:>9.2g} "
                f"{row['log_prob_bias']:>9.2g} {row['log_prob_completion_sum_max']:>9.2g} "
                f"{row['torch_ms']:>9.2f} {row['fused_ms']:>9.2f}"
            )


if __name__ == "__main__":
    main()
