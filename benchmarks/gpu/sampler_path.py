"""On a GPU: what sending every sampling step through vLLM's Triton top-k/top-p kernel costs (sampling_parity's engine
wrapper), against vLLM 0.25.1's own dispatch (steps of fewer than 8 requests take its sort path).

Times one call of vLLM's ``apply_top_k_top_p`` (original) and of the wrapped one, per batch size (requests in the
step), on float32 logits from a bf16 grid at Qwen3.5's vocabulary (248,320), for ``top_p=0.95, top_k=20`` and
``top_p=0.95`` alone; prints the ratios; checks that the rule (``vllm_rule.top_k_top_p``) and the wrapped call need no
host sync (``torch.cuda.set_sync_debug_mode("error")``) and give the same masks; counts the rows whose kept set
differs between the two paths. Writes the JSON after every variant.

    PYTHONPATH=. python benchmarks/gpu/sampler_path.py --out sampler_path.json
    python benchmarks/gpu/sampler_path.py --dry-run --out /tmp/sampler_path.json   # CPU: small vocabulary, the
        # kernel in Triton's interpreter with the engine stand-in's dispatch (no timing worth reading)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

QWEN35_VOCAB = 248_320
BATCHES = (1, 2, 4, 7, 8, 16, 64)
SETTINGS = {"top_p=0.95+top_k=20": (20, 0.95), "top_p=0.95": (None, 0.95)}


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, small vocabulary, Triton's interpreter")
    parser.add_argument("--iterations", type=int, default=None)
    return parser.parse_args()


def _functions() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """vLLM's own ``apply_top_k_top_p`` and the same function under the plugin's engine wrapper (built here, so the
    comparison does not depend on whether the plugin was applied in this process)."""
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_module
    import wrapt

    from trl_vlm_fixes.patches.sampling_parity.engine_sampler import routed, send_every_step_through_triton

    current = sampler_module.apply_top_k_top_p
    original = getattr(current, "__wrapped__", current)
    wrapped = wrapt.FunctionWrapper(original, send_every_step_through_triton)

    def in_a_trainers_rollout(*args: Any) -> Any:  # the wrapper routes the engines whose trainer computes a ratio
        with routed():
            return wrapped(*args)

    return original, in_a_trainers_rollout


def _inputs(batch: int, vocab: int, top_k: int | None, top_p: float | None, device: torch.device) -> tuple[Any, ...]:
    generator = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=generator) * 3).to(torch.bfloat16).float().to(device)
    k = None if top_k is None else torch.full((batch,), top_k, dtype=torch.int32, device=device)
    p = None if top_p is None else torch.full((batch,), top_p, dtype=torch.float32, device=device)
    return logits, k, p


def _time_ms(function: Callable[..., Any], logits: torch.Tensor, k: Any, p: Any, iterations: int) -> float:
    """Median milliseconds of one call on a fresh copy of ``logits`` (the copy's own time subtracted)."""
    work = torch.empty_like(logits)
    cuda = logits.is_cuda

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    calls, copies = [], []
    for _ in range(iterations):
        start = clock()
        work.copy_(logits)
        middle = clock()
        function(work, k, p)
        end = clock()
        copies.append(middle - start)
        calls.append(end - middle)
    return statistics.median(calls) * 1e3


def _kept(masked: torch.Tensor) -> torch.Tensor:
    return masked > float("-inf")


@contextlib.contextmanager
def _no_host_sync(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    arguments = _parse()
    dry = arguments.dry_run
    device = torch.device("cpu" if dry else "cuda")
    vocab = 4096 if dry else QWEN35_VOCAB
    batches = (1, 2, 8) if dry else BATCHES
    iterations = arguments.iterations or (2 if dry else 30)
    dispatch: Any = contextlib.nullcontext()
    if dry:  # vLLM has no Triton here: dispatch as on CUDA, with the kernel in the interpreter (the engine stand-in)
        from trl_vlm_fixes.selftest.vllm_sampler import cuda_dispatch

        dispatch = cuda_dispatch()
    from trl_vlm_fixes.patches.sampling_parity import vllm_rule

    original, wrapped = _functions()
    from trl_vlm_fixes.patches.sampling_parity.engine_sampler import every_step_on_kernel

    vllm_routes_every_size = every_step_on_kernel(original) is not None  # vLLM >= 0.31
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run: Triton's interpreter)",
        "torch": torch.__version__,
        "vocab": vocab,
        "iterations": iterations,
        "rule": vllm_rule.describe(),
        "results": [],
    }
    with dispatch:
        for name, (top_k, top_p) in SETTINGS.items():
            for batch in batches:
                logits, k, p = _inputs(batch, vocab, top_k, top_p, device)
                for function in (original, wrapped):  # warm-up: the kernel compiles on its first call
                    function(logits.clone(), k, p)
                with _no_host_sync(device):
                    by_rule = vllm_rule.top_k_top_p(logits.clone(), k, p)
                    by_wrapper = wrapped(logits.clone(), k, p)
                by_vllm = original(logits.clone(), k, p)
                vllm_ms = _time_ms(original, logits, k, p, iterations)
                wrapped_ms = _time_ms(wrapped, logits, k, p, iterations)
                row = {
                    "setting": name,
                    "batch": batch,
                    "vllm_path": "triton" if batch >= 8 or vllm_routes_every_size else "pytorch sort",
                    "vllm_ms": round(vllm_ms, 4),
                    "wrapped_ms": round(wrapped_ms, 4),
                    "wrapped_over_vllm": round(wrapped_ms / vllm_ms, 3),
                    "wrapped_equals_rule": bool(torch.equal(_kept(by_wrapper), _kept(by_rule))),
                    "rows_whose_kept_set_differs_from_vllms": int((_kept(by_wrapper) != _kept(by_vllm)).any(1).sum()),
                    "kept_wrapped_mean": float(_kept(by_wrapper).sum(1).float().mean()),
                    "kept_vllm_mean": float(_kept(by_vllm).sum(1).float().mean()),
                }
                report["results"].append(row)
                print(
                    f"{name:22s} batch {batch:3d}: vLLM {vllm_ms:8.3f} ms ({row['vllm_path']}), wrapped "
                    f"{wrapped_ms:8.3f} ms, ratio {row['wrapped_over_vllm']:.2f}, rows differing "
                    f"{row['rows_whose_kept_set_differs_from_vllms']}/{batch}",
                    flush=True,
                )
                arguments.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if not all(row["wrapped_equals_rule"] for row in report["results"]):
        sys.exit("the wrapped engine call and the trainer's rule gave different masks")


if __name__ == "__main__":
    main()
