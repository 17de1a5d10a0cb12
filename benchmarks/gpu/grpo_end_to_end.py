"""End-to-end GRPO on a Qwen3.5 VLM with TRL's colocated vLLM engine: does it train, on which weights, in which mode?

GRPOTrainer with ``use_vllm=True``, ``vllm_mode="colocate"``, sleep mode, the mixed image batch (four image sizes, four
prompt lengths in every batch) and ``gradient_accumulation_steps=2 > steps_per_generation=1`` (two rollouts per
optimizer step, the second without TRL's sync). During every rollout the engine's ``lm_head`` is compared with the
trainer's current one and with the original checkpoint; the engine's CUDA-graph mode is read from its own config.
Each variant runs in a fresh process:
    on               all fixes (``import trl_vlm_fixes``)
    off              TRL_VLM_FIXES=0: TRL 1.9.1 as released
    reload_skip_off  TRL_VLM_FIXES_RELOAD_SKIP=0: the batch trains (mm_realign), rollouts show the reload bug
    prompt_parity_off  TRL_VLM_FIXES_PROMPT_PARITY=0: vLLM expands the trainer's expanded image pads again
    PYTHONPATH=.:$SITE python benchmarks/gpu/grpo_end_to_end.py --variants on,off,reload_skip_off --out grpo.json
Every rollout also records whether the prompt ids vLLM used (``RequestOutput.prompt_token_ids``, which TRL discards)
equal the ids the trainer scores, row for row, and how long the generate took; every step its
``sampling/sampling_logp_difference`` mean and max.
``--stand-in`` swaps the engine for the behavioural stand-in (CPU dry run of the script itself, no vLLM engine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    RolloutRecorder,
    engine_additional_config,
    engine_cudagraph_mode,
    engine_gdn_prefill_kernels,
    error_lines,
    print_result,
    run_in_fresh_process,
)

VARIANT_SWITCHES = {
    "on": {},
    "off": {"TRL_VLM_FIXES": "0"},
    "reload_skip_off": {"TRL_VLM_FIXES_RELOAD_SKIP": "0"},
    "prompt_parity_off": {"TRL_VLM_FIXES_PROMPT_PARITY": "0"},
    "graphs_piecewise": {"TRL_VLM_FIXES_CUDAGRAPH_MODE": "PIECEWISE"},
    "graphs_default": {"TRL_VLM_FIXES_CUDAGRAPH_MODE": "FULL_AND_PIECEWISE"},
    "graphs_none": {"TRL_VLM_FIXES_CUDAGRAPH_MODE": "NONE"},
}
SAMPLING_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
)


class PromptParityRecorder:
    """Wraps the trainer's ``VLLMGeneration.generate`` (outermost, every fix inside): the trainer's prompt ids in,
    the prompt ids vLLM reports out, compared row for row, and the generate's wall time."""

    def __init__(self, generation: Any, image_pad_id: int | None, tags: Any) -> None:
        self.generate, self.image_pad_id, self.tags = generation.generate, image_pad_id, tags
        self.rollouts: list[dict[str, Any]] = []
        generation.generate = self._recording

    def _recording(self, prompts: Any, images: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = self.generate(prompts, images, *args, **kwargs)
        seconds = time.perf_counter() - started
        engine_ids = result[0]
        pads = [
            (list(ids).count(self.image_pad_id), list(e).count(self.image_pad_id))
            for ids, e in zip(prompts, engine_ids, strict=True)
        ]
        self.rollouts.append(
            {
                **self.tags(),
                "rows": len(prompts),
                "identical_rows": sum(list(a) == list(b) for a, b in zip(prompts, engine_ids, strict=True)),
                "image_pads_trainer_vs_engine": pads,
                "generate_s": round(seconds, 4),
            }
        )
        return result


def varied_reward(completions: list[Any], **_: Any) -> list[float | None]:
    """Any two different completions score differently, so every group has a non-zero advantage and the weights move."""
    return [(sum(ord(c) for c in str(completion)) % 997) / 997 for completion in completions]


def build_trainer(model_dir: Path, output_dir: str, steps: int, stand_in: bool) -> Any:
    import torch
    from transformers import AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, mixed_dataset

    processor = AutoProcessor.from_pretrained(model_dir)
    on_gpu = torch.cuda.is_available() and not stand_in
    config = GRPOConfig(
        output_dir=output_dir,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=1024,
        per_device_train_batch_size=8,  # 4 prompts x 2 generations: every batch holds all four mixed samples
        num_generations=2,
        gradient_accumulation_steps=2,
        steps_per_generation=1,  # < gradient_accumulation_steps: a second rollout per step, without TRL's sync
        max_completion_length=16,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        model_init_kwargs={"dtype": "bfloat16" if on_gpu else "float32"},
        # no ban of its own on vision placeholder tokens: the plugin's vision_token_guard does it
    )
    return GRPOTrainer(
        model=str(model_dir),
        reward_funcs=varied_reward,
        args=config,
        train_dataset=mixed_dataset(MIXED_SAMPLES * 4),  # 4 micro-batches an epoch: 2 full steps
        processing_class=processor,
    )


def run_variant(model_dir: Path, steps: int, stand_in: bool) -> dict[str, Any]:
    """One variant in this process: build the trainer (and its engine), train, and record every rollout."""
    import torch

    import trl_vlm_fixes

    if stand_in:
        import trl.generation.vllm_generation as vllm_generation

        from trl_vlm_fixes.selftest.engine_standin import StandInLLM

        setattr(vllm_generation, "LLM", StandInLLM)  # noqa: B010 - vllm_generation.LLM is typed as the real class
    else:
        from common import force_triton_gdn_prefill, prepare_single_process_colocate

        prepare_single_process_colocate()
        trl_vlm_fixes.REGISTRY.import_targets()
        if trl_vlm_fixes.status()["patches"]["gdn_prefill"]["state"] != "applied":
            force_triton_gdn_prefill()  # the bundles lack FlashInfer; with the plugin, gdn_prefill picks Triton itself
    result: dict[str, Any] = {}
    started = time.perf_counter()
    trainer = build_trainer(model_dir, tempfile.mkdtemp(dir=model_dir.parent), steps, stand_in)
    result["fixes"] = {name: patch["state"] for name, patch in trl_vlm_fixes.status()["patches"].items()}
    result["trainer_and_engine_start_s"] = round(time.perf_counter() - started, 1)
    engine = trainer.vllm_generation.llm
    result["engine_cudagraph_mode"] = engine_cudagraph_mode(engine)
    result["engine_gdn_prefill_backend"] = engine_additional_config(engine).get("gdn_prefill_backend")
    result["engine_gdn_prefill_kernels"] = engine_gdn_prefill_kernels(engine)
    model = trainer.accelerator.unwrap_model(trainer.model)
    recorder = RolloutRecorder(engine, model.lm_head.weight, tags=lambda: {"global_step": trainer.state.global_step})
    parity = PromptParityRecorder(
        trainer.vllm_generation,
        getattr(trainer.processing_class, "image_token_id", None),
        tags=lambda: {"global_step": trainer.state.global_step},
    )
    started = time.perf_counter()
    try:
        trainer.train()
        result["trained"] = True
    except Exception as error:  # noqa: BLE001 - the failure itself is the finding for the "off" variant
        result["trained"] = False
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    result["train_s"] = round(time.perf_counter() - started, 1)
    result["global_steps"] = trainer.state.global_step
    result["rollouts"] = recorder.rollouts
    result["disk_reloads"] = recorder.disk_reloads
    result["losses"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    result["prompt_parity"] = parity.rollouts
    result["sampling"] = [
        {
            "step": log.get("step"),
            "step_time": log.get("step_time"),
            **{n: log[n] for n in SAMPLING_METRICS if n in log},
        }
        for log in trainer.state.log_history
        if "loss" in log
    ]
    result["plugin_metrics"] = [
        {key: value for key, value in log.items() if key.startswith("trl_vlm_fixes/")}
        for log in trainer.state.log_history
        if any(key.startswith("trl_vlm_fixes/") for key in log)
    ]
    result["weights_trained"] = not bool(torch.equal(model.lm_head.weight.detach(), recorder.original))
    return result


def rollout_share(result: dict[str, Any]) -> list[float | None]:
    """Per logged step after the first (which holds the engine's warm-up), the generate time over TRL's step_time."""
    shares: list[float | None] = []
    for logged in result.get("sampling", [])[1:]:
        step, step_time = logged.get("step"), logged.get("step_time")
        rollout = sum(r["generate_s"] for r in result.get("prompt_parity", []) if r["global_step"] == step - 1)
        shares.append(round(rollout / step_time, 3) if step_time else None)
    return shares


def summarize(variant: str, result: dict[str, Any]) -> dict[str, Any]:
    rollouts = result.get("rollouts", [])
    parity = result.get("prompt_parity", [])
    after_first_step = [r for r in rollouts if r["trainer_moved_from_original"]]
    return {
        "variant": variant,
        "trained": result.get("trained"),
        "steps": result.get("global_steps"),
        "rollouts": len(rollouts),
        "on_current": sum(r["on_current"] for r in rollouts),
        "on_original_after_training_moved": sum(r["on_original"] for r in after_first_step),
        "all_zero": sum(r["all_zero"] for r in rollouts),
        "disk_reloads": result.get("disk_reloads"),
        "cudagraph_mode": result.get("engine_cudagraph_mode"),
        "identical_prompt_rows": f"{sum(r['identical_rows'] for r in parity)}/{sum(r['rows'] for r in parity)}",
        "logp_difference_mean": [s.get(SAMPLING_METRICS[0]) for s in result.get("sampling", [])],
        "logp_difference_max": [s.get(SAMPLING_METRICS[1]) for s in result.get("sampling", [])],
        "rollout_share_of_step": rollout_share(result),
        "error": result.get("error", ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="on,off,reload_skip_off")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="grpo_end_to_end.json")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per variant (a hang is a finding too)")
    parser.add_argument("--stand-in", action="store_true", help="CPU dry run with the behavioural stand-in engine")
    parser.add_argument("--hidden", type=int, default=512, help="text hidden size (2048 with --layers 16: ~1.2B)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print_result(run_variant(Path(args.model_dir), args.steps, args.stand_in))
        return
    unknown = set(args.variants.split(",")) - set(VARIANT_SWITCHES)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANT_SWITCHES)}")
    from common import build_random_qwen35

    scratch = tempfile.TemporaryDirectory()  # the model and each variant's output_dir; removed when main returns
    model_dir = build_random_qwen35(Path(scratch.name) / "model", hidden=args.hidden, layers=args.layers)
    report: dict[str, Any] = {"steps": args.steps, "stand_in": args.stand_in, "hidden": args.hidden, "variants": {}}
    if not args.stand_in:
        from common import versions

        report["versions"] = versions()
    for variant in args.variants.split(","):
        command = [__file__, "--one", variant, "--model-dir", str(model_dir), "--steps", str(args.steps)]
        command += ["--stand-in"] if args.stand_in else []
        environment = {key: value for key, value in os.environ.items() if not key.startswith("TRL_VLM_FIXES")}
        environment.update(VARIANT_SWITCHES[variant])
        result, run = run_in_fresh_process(command, timeout=args.timeout, env=environment)
        if run is None:
            report["variants"][variant] = {"trained": False, "error": f"no result within {args.timeout} s (hang?)"}
            print(f"{variant}: timed out after {args.timeout} s", flush=True)
            continue
        if result is None:
            error = "\n".join(error_lines(run)[-5:]) or f"exit {run.returncode}"
            report["variants"][variant] = {"trained": False, "error": error}
            print(f"{variant}: failed (exit {run.returncode})\n" + "\n".join(run.stderr.splitlines()[-25:]), flush=True)
            continue
        result["log_lines"] = [
            line.strip()[-240:]
            for line in (run.stdout + run.stderr).splitlines()
            if "GDN prefill kernel" in line or "trl_vlm_fixes:" in line
        ][:12]
        report["variants"][variant] = result
        print(json.dumps(summarize(variant, report["variants"][variant])), flush=True)
        print("\n".join(result["log_lines"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    header = ("variant", "trained", "steps", "rollouts", "on current", "on original*", "all zero", "reloads", "mode")
    print("".join(f"{h:>16}" for h in header))
    for variant, result in report["variants"].items():
        row = summarize(variant, result)
        cells = [row[k] for k in ("variant", "trained", "steps", "rollouts", "on_current")]
        cells += [row[k] for k in ("on_original_after_training_moved", "all_zero", "disk_reloads", "cudagraph_mode")]
        print("".join(f"{c!s:>16}" for c in cells) + (f"   {row['error'][:120]}" if row["error"] else ""))
    print("* rollouts on the original checkpoint although the trainer's weights had already moved away from it")


if __name__ == "__main__":
    main()
