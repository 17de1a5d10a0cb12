"""Prefill throughput of the Gated-DeltaNet Triton/FLA prefill kernel (what ``gdn_prefill`` selects), with vLLM's
default CUDA graphs, on the random ~1.2B Qwen3.5 of decode_throughput.py: batches of 16 prompts of 512, 2048 and 4096
tokens, one new token each, median of 3. The engine gets ``gdn_prefill_backend="triton"`` as the plugin passes it.
    PYTHONPATH=.:$SITE python benchmarks/gpu/prefill_throughput.py --out prefill_throughput.json
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
from common import build_random_qwen35, engine_additional_config, versions

MODEL_DIR = Path(os.environ.get("TRL_VLM_FIXES_BENCH_MODEL", "/tmp/trl_vlm_fixes_qwen35_1b"))


def prompts(batch: int, length: int, salt: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 3 * j + salt) % 250 + 3 for j in range(length)]} for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="512,2048,4096")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default="prefill_throughput.json")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not (MODEL_DIR / "config.json").exists():
        build_random_qwen35(MODEL_DIR, hidden=2048, layers=16)
    from vllm import LLM, SamplingParams

    lengths = [int(n) for n in args.lengths.split(",")]
    started = time.perf_counter()
    llm = LLM(
        model=str(MODEL_DIR),
        gpu_memory_utilization=0.5,
        max_model_len=max(lengths) + 64,
        max_num_batched_tokens=8192,
        seed=0,
        gdn_prefill_backend="triton",
        logprobs_mode="processed_logprobs",
        limit_mm_per_prompt={"image": 0, "video": 0},
    )
    result = {"versions": versions(), "engine_start_s": round(time.perf_counter() - started, 1)}
    result["engine_gdn_prefill_backend"] = engine_additional_config(llm).get("gdn_prefill_backend")
    sampling = SamplingParams(temperature=0.0, max_tokens=1)
    for length in lengths:
        llm.generate(prompts(args.batch, length, 1)[:2], sampling, use_tqdm=False)  # warm-up
        rates = []
        for repeat in range(3):
            batch = prompts(args.batch, length, 100 + repeat)  # new tokens every time: no prefix-cache hits
            t = time.perf_counter()
            llm.generate(batch, sampling, use_tqdm=False)
            rates.append(args.batch * length / (time.perf_counter() - t))
        result[f"prefill_{length}_tok_s"] = round(statistics.median(rates))
        print(length, result[f"prefill_{length}_tok_s"], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
