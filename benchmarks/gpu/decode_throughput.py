"""Decode throughput of vLLM 0.25.1 per CUDA-graph mode, on a random ~1.2B Qwen3.5 (real 3:1 GDN/full layout).

Greedy 256 new tokens from 128-token prompts, batches of 64 and 16, median of 3; each mode in a fresh process.
    PYTHONPATH=.:$SITE python benchmarks/gpu/decode_throughput.py --modes default,PIECEWISE,NONE,FULL_DECODE_ONLY,eager
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import error_lines, print_result, run_in_fresh_process

MODEL_DIR = Path(os.environ.get("TRL_VLM_FIXES_BENCH_MODEL", "/tmp/trl_vlm_fixes_qwen35_1b"))


def engine_arguments(mode: str) -> dict:
    if mode == "eager":
        return {"enforce_eager": True}
    if mode == "default":
        return {}
    return {"compilation_config": {"cudagraph_mode": mode}}


def measure(mode: str) -> dict:
    """One mode, in this process: build the engine, then time greedy decoding."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core, as in TRL's colocate mode
    from common import force_triton_gdn_prefill
    from vllm import LLM, SamplingParams

    force_triton_gdn_prefill()
    started = time.perf_counter()
    llm = LLM(
        model=str(MODEL_DIR),
        gpu_memory_utilization=0.5,
        max_model_len=512,
        seed=0,
        gdn_prefill_backend="triton",
        logprobs_mode="processed_logprobs",  # as TRL passes it; also keeps the absent FlashInfer sampler out
        limit_mm_per_prompt={"image": 0, "video": 0},
        **engine_arguments(mode),
    )
    start_s = time.perf_counter() - started
    sampling = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    result = {"mode": mode, "engine_start_s": round(start_s, 1)}
    for batch in (64, 16):
        prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(128)]} for i in range(batch)]
        llm.generate(prompts[:4], sampling, use_tqdm=False)  # warm-up
        rates = []
        for _ in range(3):
            t = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            elapsed = time.perf_counter() - t
            rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
        result[f"batch{batch}_tok_s"] = round(statistics.median(rates))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", default="default,PIECEWISE,NONE,FULL_DECODE_ONLY,eager")
    parser.add_argument("--out", default="decode_throughput.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print_result(measure(args.one))
        return
    from common import build_random_qwen35, versions

    if not (MODEL_DIR / "config.json").exists():
        build_random_qwen35(MODEL_DIR, hidden=2048, layers=16)
    results = []
    for mode in args.modes.split(","):
        result, run = run_in_fresh_process([__file__, "--one", mode])
        if result is None:
            print(f"{mode}: failed\n" + "\n".join(error_lines(run)[-15:] if run else []))
            continue
        results.append(result)
        print(results[-1], flush=True)
    Path(args.out).write_text(json.dumps({"versions": versions(), "results": results}, indent=2))
    print(f"{'mode':<20}{'batch 64 tok/s':>16}{'batch 16 tok/s':>16}{'engine start s':>16}")
    for r in results:
        print(f"{r['mode']:<20}{r['batch64_tok_s']:>16}{r['batch16_tok_s']:>16}{r['engine_start_s']:>16}")


if __name__ == "__main__":
    main()
