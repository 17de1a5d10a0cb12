"""A Qwen3.5 MoE VLM (random weights, a few experts) trained through TRL's colocated vLLM engine with sleep mode and
the plugin: after every push the engine serves the trainer's weights, experts included; vLLM samples from the
trainer's prompt ids; the mixed image batch is scored and trained.

TRL 1.9.1's GRPOTrainer, ``use_vllm=True``, ``vllm_mode="colocate"``, ``vllm_enable_sleep_mode=True``, the four mixed
samples (four image sizes, four prompt lengths in every batch), ``gradient_accumulation_steps=2 >
steps_per_generation=1`` (two rollouts per optimizer step, the second without TRL's sync), as
``grpo_end_to_end.py``. During every rollout (after TRL's sync or the plugin's re-push) every tensor of the engine's
model (``llm.llm_engine.model_executor.driver_worker.model_runner.model``) is compared with the trainer's tensor(s)
it stands for: vLLM's fused-MoE ``w13_weight`` / ``w2_weight`` with transformers 5's ``experts.gate_up_proj`` /
``experts.down_proj``, its stacked projections with the HF rows concatenated, its padded vocabulary sliced
(``common.compare_engine_weights``); and with the checkpoint, to tell a stale engine from a fresh one. The prompt ids
vLLM reports are compared with the trainer's, row for row (``common.PromptParityRecorder``).
    PYTHONPATH=.:$SITE python benchmarks/gpu/moe_colocate.py --out moe.json
    python benchmarks/gpu/moe_colocate.py --stand-in --hidden 64 --out moe.json    # CPU dry run (engine stand-in)
    python benchmarks/gpu/moe_colocate.py --cpu-loader-check --out loader.json     # CPU: vLLM's own model + loader
``--stand-in``: the behavioural engine stand-in (CPU); its weights are a dict under the HF names TRL pushes, compared by
the same code. ``--cpu-loader-check``: no engine and no trainer; vLLM 0.25.1's own model class of a tiny MoE checkpoint
is built on the CPU, every HF parameter is pushed into it one at a time with its ``load_weights`` (TRL's colocate
push), and the comparison must find every tensor, experts included; then one expert is changed in the trainer only
(the comparison must flag exactly that tensor) and pushed (it must match again); before any push (vLLM's random
weights) nothing may match.
vLLM's MoE kernels live in ``vllm/_moe_C_stable_libtorch.abi3.so``, which the offline bundles of
``../shared/gpu/make_bundles.sh`` leave out: ``benchmarks/gpu/run_issue32.sh`` installs it first.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    EngineWeightsRecorder,
    PromptParityRecorder,
    RolloutRecorder,
    build_grpo_trainer,
    build_tiny_vlm,
    compare_engine_weights,
    engine_cudagraph_mode,
    fix_states,
    print_result,
    use_engine,
    variant_in_fresh_process,
)

VARIANT_SWITCHES = {
    "on": {},
    "reload_skip_off": {"TRL_VLM_FIXES_RELOAD_SKIP": "0"},  # the comparison's contrast: stale experts after step 0
    "prompt_parity_off": {"TRL_VLM_FIXES_PROMPT_PARITY": "0"},
}
FAMILIES = ("qwen3_5_moe", "qwen3_vl_moe")


def engine_moe_backends(engine: Any) -> list[str]:
    """The unquantized fused-MoE backend each MoE layer of the in-process engine chose (Triton without FlashInfer)."""
    try:
        model = engine.llm_engine.model_executor.driver_worker.model_runner.model
    except AttributeError:
        return []
    if not hasattr(model, "modules"):  # the CPU stand-in
        return []
    backends = set()
    for module in model.modules():
        backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
        if backend is not None:
            backends.add(str(getattr(backend, "value", backend)))
    return sorted(backends)


def moe_kernels() -> str:
    """Whether vLLM's MoE kernel library imports (the offline bundles lack it; run_issue32.sh installs it)."""
    try:
        import vllm._moe_C_stable_libtorch  # noqa: F401
    except ImportError as error:
        return f"missing: {error}"
    return "importable"


def run_variant(model_dir: Path, steps: int, stand_in: bool, max_completion_length: int = 16) -> dict[str, Any]:
    """One variant in this process: build the trainer (and its engine), train, record every rollout."""
    import torch

    use_engine(stand_in)
    result: dict[str, Any] = {"moe_kernels": "stand-in" if stand_in else moe_kernels()}
    started = time.perf_counter()
    output_dir = tempfile.mkdtemp(dir=model_dir.parent)
    trainer = build_grpo_trainer(model_dir, output_dir, steps, stand_in, max_completion_length=max_completion_length)
    result["fixes"] = fix_states()
    result["trainer_and_engine_start_s"] = round(time.perf_counter() - started, 1)
    engine = trainer.vllm_generation.llm
    result["engine_cudagraph_mode"] = engine_cudagraph_mode(engine)
    result["engine_moe_backends"] = engine_moe_backends(engine)
    model = trainer.accelerator.unwrap_model(trainer.model)
    result["trainer_model"] = type(model).__name__
    result["trainer_dtype"] = str(next(model.parameters()).dtype)

    def tags() -> dict[str, Any]:
        return {"global_step": trainer.state.global_step}

    freshness = RolloutRecorder(engine, model.lm_head.weight, tags=tags)  # counts disk reloads too
    weights = EngineWeightsRecorder(engine, model, tags=tags)
    parity = PromptParityRecorder(
        trainer.vllm_generation, getattr(trainer.processing_class, "image_token_id", None), tags=tags
    )
    started = time.perf_counter()
    try:
        trainer.train()
        result["trained"] = True
    except Exception as error:  # noqa: BLE001 - a failure is a finding
        result["trained"] = False
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    result["train_s"] = round(time.perf_counter() - started, 1)
    result["global_steps"] = trainer.state.global_step
    result["losses"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    result["losses_finite"] = bool(result["losses"]) and all(math.isfinite(loss) for loss in result["losses"])
    result["weights"] = weights.rollouts
    result["lm_head_rollouts"] = freshness.rollouts
    result["disk_reloads"] = freshness.disk_reloads
    result["prompt_parity"] = parity.rollouts
    result["logged"] = [
        {
            key: value
            for key, value in log.items()
            if key in ("step", "loss", "step_time") or key.startswith(("trl_vlm_fixes/", "sampling/"))
        }
        for log in trainer.state.log_history
        if "loss" in log
    ]
    result["weights_trained"] = not bool(torch.equal(model.lm_head.weight.detach(), freshness.original))
    return result


def summarize(variant: str, result: dict[str, Any]) -> dict[str, Any]:
    rollouts = result.get("weights", [])
    parity = result.get("prompt_parity", [])
    whole = [
        r
        for r in rollouts
        if r["tensors_compared"] and r["tensors_within_bf16"] == r["tensors_compared"] and not r["unfit"]
    ]
    stale = [r for r in rollouts if r["expert_tensors_moved_in_trainer"] and r["expert_tensors_on_original"]]
    return {
        "variant": variant,
        "trained": result.get("trained"),
        "steps": result.get("global_steps"),
        "losses_finite": result.get("losses_finite"),
        "rollouts": len(rollouts),
        "engine_is_trainer": len(whole),
        "experts_within_bf16": f"{sum(r['expert_tensors_within_bf16'] for r in rollouts)}"
        f"/{sum(r['expert_tensors_compared'] for r in rollouts)}",
        "stale_expert_rollouts": len(stale),
        "unmapped_trainer": max((r["unmapped_trainer_count"] for r in rollouts), default=None),
        "identical_prompt_rows": f"{sum(r['identical_rows'] for r in parity)}/{sum(r['rows'] for r in parity)}",
        "disk_reloads": result.get("disk_reloads"),
        "moe_backends": result.get("engine_moe_backends"),
        "error": result.get("error", ""),
    }


# --- vLLM's own model class and loader on the CPU (no engine) --------------------------------------------------------


def vllm_model_on_cpu(model_dir: Path) -> Any:
    """vLLM's own model class for ``model_dir``, built on the CPU in float32 by vLLM's loader with random weights
    (``load_format="dummy"``: a tensor the push never reaches cannot match), with no engine: its parameters, their
    names and shapes and its ``load_weights`` are the real engine's (``trl_vlm_fixes.selftest.vllm_model``)."""
    from trl_vlm_fixes.selftest.vllm_model import build_vllm_model

    return build_vllm_model(model_dir, load_format="dummy").model


def push_like_trl(engine_model: Any, named: list[tuple[str, Any]]) -> None:
    """TRL 1.9.1's colocate sync: ``load_weights([(name, param)])`` for one parameter at a time."""
    for name, parameter in named:
        engine_model.load_weights([(name.replace("_checkpoint_wrapped_module.", ""), parameter.detach())])


def cpu_loader_check(family: str, directory: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = build_tiny_vlm(directory / family, family, moe_intermediate=24)  # 2I = 48 != hidden 32
    trainer = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    started = time.perf_counter()
    engine_model = vllm_model_on_cpu(model_dir)
    report: dict[str, Any] = {"family": family, "vllm_model": type(engine_model).__name__}
    report["build_s"] = round(time.perf_counter() - started, 1)
    named = list(trainer.named_parameters())
    report["trainer_parameters"] = len(named)
    report["engine_parameters"] = sum(1 for _ in engine_model.named_parameters())
    report["engine_expert_shapes"] = {
        name: list(p.shape) for name, p in engine_model.named_parameters() if "layers.0.mlp.experts" in name
    }
    engine = dict(engine_model.named_parameters())
    report["before_push"] = compare_engine_weights(dict(named), engine)  # vLLM's random weights: nothing matches
    push_like_trl(engine_model, named)
    report["after_push"] = compare_engine_weights(dict(named), engine)
    changed = next(name for name, _ in named if name.endswith("layers.0.mlp.experts.gate_up_proj"))
    with torch.no_grad():
        dict(named)[changed][1].add_(0.5)  # expert 1 of layer 0 moves in the trainer only
    report["changed_in_trainer_only"] = changed
    report["stale_expert"] = compare_engine_weights(dict(named), engine)
    push_like_trl(engine_model, [(changed, dict(named)[changed])])
    report["after_repush"] = compare_engine_weights(dict(named), engine)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="on")
    parser.add_argument("--family", default="qwen3_5_moe", help=f"one of {FAMILIES} (--cpu-loader-check: a list)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512, help="text hidden size")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3.5: 3 Gated-DeltaNet : 1 full)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--experts-per-token", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=0, help="expert width (default: 3/4 of hidden)")
    parser.add_argument("--out", default="moe_colocate.json")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per variant (a hang is a finding too)")
    parser.add_argument("--stand-in", action="store_true", help="CPU dry run with the behavioural stand-in engine")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny shape (hidden 32; CPU dry runs)")
    parser.add_argument(
        "--max-completion-length", type=int, default=16, help="new tokens per rollout (CPU dry runs: 8)"
    )
    parser.add_argument("--cpu-loader-check", action="store_true", help="vLLM's own model class and loader, on the CPU")
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print_result(run_variant(Path(args.model_dir), args.steps, args.stand_in, args.max_completion_length))
        return
    scratch = tempfile.TemporaryDirectory()  # the model and each variant's output_dir; removed when main returns
    if args.cpu_loader_check:
        checks = [cpu_loader_check(family, Path(scratch.name)) for family in args.family.split(",")]
        Path(args.out).write_text(json.dumps({"cpu_loader_check": checks}, indent=2))
        for check in checks:
            print(json.dumps({key: check[key] for key in ("family", "vllm_model", "engine_expert_shapes")}))
            for stage in ("before_push", "after_push", "stale_expert", "after_repush"):
                row = check[stage]
                print(
                    f"  {stage:14} within bf16 {row['tensors_within_bf16']}/{row['tensors_compared']}, experts "
                    f"{row['expert_tensors_within_bf16']}/{row['expert_tensors_compared']} ({row['expert_layouts']}),"
                    f" unmapped engine {row['unmapped_engine_count']} trainer {row['unmapped_trainer_count']},"
                    f" differing {row['differing']}"
                )
        return
    unknown = set(args.variants.split(",")) - set(VARIANT_SWITCHES)
    if unknown or args.family not in FAMILIES:
        parser.error(f"variants from {sorted(VARIANT_SWITCHES)}, family from {FAMILIES}")
    from common import build_random_qwen35

    shape: dict[str, Any] = {
        "family": args.family,
        "hidden": args.hidden,
        "layers": args.layers,
        "experts": args.experts,
        "experts_per_token": args.experts_per_token,
        "moe_intermediate": args.moe_intermediate or args.hidden * 3 // 4,
    }
    started = time.perf_counter()
    if args.tiny:
        shape = {"family": args.family, "hidden": 32, "layers": 2, "experts": 4, "experts_per_token": 2}
        shape["moe_intermediate"] = 24  # 2I = 48 != hidden 32
        model_dir = build_tiny_vlm(Path(scratch.name) / "model", args.family, shape["moe_intermediate"])
    else:
        model_dir = build_random_qwen35(
            Path(scratch.name) / "model",
            hidden=args.hidden,
            layers=args.layers,
            family=args.family,
            experts=args.experts,
            experts_per_token=args.experts_per_token,
            moe_intermediate=shape["moe_intermediate"],
        )
    report: dict[str, Any] = {"steps": args.steps, "stand_in": args.stand_in, "shape": shape, "variants": {}}
    report["max_completion_length"] = args.max_completion_length
    report["model_build_s"] = round(time.perf_counter() - started, 1)
    if not args.stand_in:
        from common import versions

        report["versions"] = versions()
    for variant in args.variants.split(","):
        Path(args.out).write_text(json.dumps(report, indent=2))  # the variants done so far outlive a killed call
        arguments = ["--model-dir", str(model_dir), "--steps", str(args.steps)]
        arguments += ["--max-completion-length", str(args.max_completion_length)]
        arguments += ["--stand-in"] if args.stand_in else []
        result, run, error = variant_in_fresh_process(
            __file__, variant, arguments, VARIANT_SWITCHES[variant], args.timeout
        )
        if result is None or run is None:
            report["variants"][variant] = {"trained": False, "error": error}
            continue
        report["variants"][variant] = result
        print(json.dumps(summarize(variant, result)), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    header = ("variant", "trained", "steps", "finite loss", "rollouts", "engine=trainer", "experts ok", "stale")
    header += ("prompts",)
    print("".join(f"{h:>16}" for h in header))
    for variant, result in report["variants"].items():
        row = summarize(variant, result)
        cells = [row[k] for k in ("variant", "trained", "steps", "losses_finite", "rollouts", "engine_is_trainer")]
        cells += [row[k] for k in ("experts_within_bf16", "stale_expert_rollouts", "identical_prompt_rows")]
        print("".join(f"{c!s:>16}" for c in cells) + (f"   {row['error'][:120]}" if row["error"] else ""))
    print("engine=trainer: rollouts where every engine tensor was within bf16 rounding of the trainer's;")
    print("stale: rollouts whose engine experts were the checkpoint's although the trainer's had moved")
    for variant, result in report["variants"].items():
        for rollout in result.get("weights", []):
            print(
                f"  {variant} step {rollout['global_step']}: {rollout['tensors_within_bf16']}/"
                f"{rollout['tensors_compared']} tensors, experts {rollout['expert_tensors_within_bf16']}/"
                f"{rollout['expert_tensors_compared']} ({rollout['expert_layouts']}), max diff "
                f"{rollout['max_abs_diff']:.3g}, unmapped trainer {rollout['unmapped_trainer_count']}"
            )


if __name__ == "__main__":
    main()
