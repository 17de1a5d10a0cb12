"""Which weights each rollout of TRL's colocated vLLM engine (sleep mode) runs on, with the fixes off and on.

TRL's real VLLMGeneration on the real vLLM engine: per step an optimizer update of the trainer's weights, TRL's sync
(global_step changed), then two generates (steps_per_generation < gradient_accumulation_steps). During each generate
the engine's lm_head is read and compared with the trainer's current lm_head and with the original checkpoint.
    PYTHONPATH=.:$SITE python benchmarks/gpu/weight_freshness.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import trl_vlm_fixes

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    RolloutRecorder,
    build_random_qwen35,
    engine_cudagraph_mode,
    force_triton_gdn_prefill,
    prepare_single_process_colocate,
    versions,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="weight_freshness.json")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    prepare_single_process_colocate()
    force_triton_gdn_prefill()
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl.generation.vllm_generation import VLLMGeneration

    model_dir = build_random_qwen35(tempfile.mkdtemp(), args.hidden, args.layers)
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    started = time.perf_counter()
    # a GRPO run's colocated, sleeping engine, kept small: the question is only which weights it serves
    engine = {"mode": "colocate", "enable_sleep_mode": True, "gpu_memory_utilization": 0.3, "max_model_length": 512}
    sampling = {"max_num_seqs": 8, "max_completion_length": 16, "temperature": 1.0}
    generation = VLLMGeneration(
        model=model, accelerator=Accelerator(), processing_class=processor, **engine, **sampling
    )
    engine_start_s = time.perf_counter() - started
    recorder = RolloutRecorder(generation.llm, model.lm_head.weight)
    prompts = [processor.tokenizer.encode("hello there, how are you?")] * 4
    results = {}
    for label, on in (("fixes off (TRL 1.9.1)", False), ("fixes on", True)):
        trl_vlm_fixes.revert()
        if on:
            trl_vlm_fixes.apply()
        recorder.clear()
        generate_s, sync_s = [], []
        for _step in range(args.steps):
            with torch.no_grad():  # the optimizer step: the trainer's weights move
                for parameter in model.parameters():
                    parameter.add_(torch.randn_like(parameter) * 1e-2)
            t = time.perf_counter()
            generation.sync_weights()  # TRL syncs once per global_step
            sync_s.append(time.perf_counter() - t)
            for _ in range(2):  # a second rollout in the same step: TRL does not sync again
                t = time.perf_counter()
                generation.generate(prompts=prompts, images=None, num_generations=1)
                generate_s.append(time.perf_counter() - t)
        results[label] = {
            "generates": len(recorder.rollouts),
            "on_current_weights": sum(r["on_current"] for r in recorder.rollouts),
            "on_original_checkpoint": sum(r["on_original"] for r in recorder.rollouts),
            "on_all_zero_weights": sum(r["all_zero"] for r in recorder.rollouts),
            "disk_reloads": recorder.disk_reloads,
            "median_generate_s": sorted(generate_s)[len(generate_s) // 2],
            "median_sync_s": sorted(sync_s)[len(sync_s) // 2],
            "rollouts": list(recorder.rollouts),
        }
    report = {
        "versions": versions(),
        "engine_start_s": engine_start_s,
        "hidden": args.hidden,
        "layers": args.layers,
        "steps": args.steps,
        "results": results,
        "compilation_config": engine_cudagraph_mode(generation.llm),
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(
        f"{'':24}{'generates':>10}{'on current':>12}{'on original':>13}{'all zero':>10}{'disk reloads':>14}"
        f"{'generate s':>12}"
    )
    for label, r in results.items():
        print(
            f"{label:24}{r['generates']:>10}{r['on_current_weights']:>12}{r['on_original_checkpoint']:>13}"
            f"{r['on_all_zero_weights']:>10}{r['disk_reloads']:>14}{r['median_generate_s']:>12.3f}"
        )
    print(f"engine cudagraph_mode: {report['compilation_config']}; versions: {report['versions']}")


if __name__ == "__main__":
    main()
