"""What PIECEWISE costs against vLLM's own CUDA graphs, by requests per engine step, for Qwen3.5 shapes: the cost
table of the cudagraph fix (PIECEWISE only after an engine hang; vLLM's mode by default).

One fresh process per (shape, mode): a vLLM 0.25.1 engine built from a ``config.json`` alone (``load_format="dummy"``,
random weights; realistic_decode.py writes it) with TRL 1.9.1's colocate arguments (``external_launcher``,
``max_num_batched_tokens=4096``, ``processed_logprobs``, Triton GDN prefill, text only); then, in that engine, decode
at each batch size: that many 256-token prompts at once, 256 sampled tokens each (temperature 1, ``ignore_eos``,
``logprobs=0``), median tokens/s of ``--repeats``. A colocated rank decodes ``per_device_train_batch_size x
steps_per_generation`` sequences at once, typically 16-64. The JSON is written after every engine.
    PYTHONPATH=.:$SITE python benchmarks/gpu/cudagraph_decode.py --out cudagraph_decode.json
    # cut to fit: --shapes 2b --modes FULL_AND_PIECEWISE,PIECEWISE --batches 16,64,256 --repeats 1
    # dry run on the CPU (the engine stand-in, the tests' tiny shape):
    python benchmarks/gpu/cudagraph_decode.py --stand-in --tiny --batches 2,4 --tokens 4 --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import realistic_decode
from common import build_tiny_vlm, error_lines, print_result, run_in_fresh_process

# Qwen3.5 2B-class text stack (hidden 2048, 24 layers, 3:1 Gated-DeltaNet:full attention) at the real vocabulary
SHAPE_2B: dict[str, Any] = {
    **realistic_decode.SHAPE_9B,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
}
SHAPES = {"2b": SHAPE_2B, "9b": realistic_decode.SHAPE_9B}


def write_checkpoint(directory: Path, shape: dict[str, Any]) -> Path:
    """realistic_decode's config-only checkpoint, at ``shape``."""
    saved = realistic_decode.SHAPE_9B
    realistic_decode.SHAPE_9B = shape
    try:
        return realistic_decode.write_config_only_checkpoint(directory)
    finally:
        realistic_decode.SHAPE_9B = saved


def build_engine(model_dir: str, mode: str, max_requests: int, tokens: int, stand_in: bool) -> tuple[Any, Any]:
    """The engine as TRL 1.9.1's colocate mode builds it, with ``cudagraph_mode`` (``default``: vLLM's own), and its
    SamplingParams class."""
    compilation = {} if mode == "default" else {"compilation_config": {"cudagraph_mode": mode}}
    if stand_in:
        from vllm import SamplingParams as VllmSamplingParams  # imports on the CPU; the stand-in samples with it

        from trl_vlm_fixes.selftest.engine_standin import StandInLLM

        return StandInLLM(model_dir, max_num_seqs=max_requests, **compilation), VllmSamplingParams
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core, as in TRL's colocate mode
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29563")
    from common import force_triton_gdn_prefill
    from vllm import LLM, SamplingParams

    force_triton_gdn_prefill()
    engine = LLM(
        model=model_dir,
        load_format="dummy",
        dtype="bfloat16",
        gpu_memory_utilization=0.6,
        max_model_len=2 * tokens + 64,
        max_num_seqs=max_requests,
        distributed_executor_backend="external_launcher",
        seed=0,
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
        gdn_prefill_backend="triton",
        limit_mm_per_prompt={"image": 0, "video": 0},
        enable_sleep_mode=True,
        **compilation,
    )
    return engine, SamplingParams


def measure(model_dir: str, mode: str, batches: list[int], tokens: int, repeats: int, stand_in: bool) -> dict:
    """One engine: decode tokens/s at each batch size."""
    from common import engine_cudagraph_mode

    started = time.perf_counter()
    engine, sampling_params = build_engine(model_dir, mode, max(batches), tokens, stand_in)
    result: dict[str, Any] = {"mode": mode, "engine_start_s": round(time.perf_counter() - started, 1)}
    result["cudagraph_mode_built"] = engine_cudagraph_mode(engine)
    params = sampling_params(temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(tokens)]} for i in range(max(batches))]
    engine.generate(prompts[: min(batches)], params, use_tqdm=False)  # warm-up
    result["tok_s"] = {}
    for batch in batches:
        rates = []
        for _ in range(repeats):
            t = time.perf_counter()
            outputs = engine.generate(prompts[:batch], params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - t))
        result["tok_s"][str(batch)] = round(statistics.median(rates), 1)
        print(json.dumps({"mode": mode, "batch": batch, "tok_s": [round(r) for r in rates]}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2b,9b", help="2b, 9b")
    parser.add_argument("--modes", default="FULL_AND_PIECEWISE,PIECEWISE", help="vLLM modes, or default")
    parser.add_argument("--batches", default="16,32,64,128,256", help="requests per engine step")
    parser.add_argument("--tokens", type=int, default=256, help="prompt and sampled tokens per request")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=560, help="seconds per engine")
    parser.add_argument("--stand-in", action="store_true", help="the CPU engine stand-in (a dry run)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny shape (with --stand-in)")
    parser.add_argument("--out", default="cudagraph_decode.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(batch) for batch in args.batches.split(",")]
    if args.one:
        print_result(measure(args.model_dir, args.one, batches, args.tokens, args.repeats, args.stand_in))
        return
    report: dict[str, Any] = {"batches": batches, "tokens": args.tokens, "stand_in": args.stand_in, "shapes": {}}
    if not args.stand_in:
        from common import versions

        report["versions"] = versions()
    for shape in args.shapes.split(","):
        folder = Path(tempfile.mkdtemp()) / f"qwen35-{shape}"
        model_dir = build_tiny_vlm(folder) if args.tiny else write_checkpoint(folder, SHAPES[shape])
        results = report["shapes"].setdefault(shape, {})
        for mode in args.modes.split(","):
            command = [__file__, "--one", mode, "--model-dir", str(model_dir), "--batches", args.batches]
            command += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
            command += ["--stand-in"] if args.stand_in else []
            result, run = run_in_fresh_process(command, timeout=args.timeout)
            if result is None:
                tail = "\n".join(error_lines(run)[-15:]) if run else f"timed out after {args.timeout} s"
                print(f"{shape} {mode}: failed\n{tail}", flush=True)
                results[mode] = {"error": tail[-2000:]}
            else:
                results[mode] = result
            Path(args.out).write_text(json.dumps(report, indent=2))
        baseline = results.get("FULL_AND_PIECEWISE", results.get("default", {})).get("tok_s")
        for result in results.values():
            if baseline and "tok_s" in result:
                result["vs_vllm_default"] = {b: round(r / baseline[b], 2) for b, r in result["tok_s"].items()}
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'shape':<6}{'mode':<20}" + "".join(f"{b:>9}" for b in batches))
    for shape, results in report["shapes"].items():
        for mode, result in results.items():
            ratios = result.get("vs_vllm_default", {})
            cells = [f"{ratios[str(b)]:.2f}x" if str(b) in ratios else "-" for b in batches]
            print(f"{shape:<6}{mode:<20}" + "".join(f"{cell:>9}" for cell in cells))


if __name__ == "__main__":
    main()
