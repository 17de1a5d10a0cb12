"""End-to-end GRPO on a Qwen3.5 VLM with TRL's colocated vLLM engine: does it train, on which weights, in which mode,
and what does TRL's importance-sampling ratio say?

GRPOTrainer with ``use_vllm=True``, ``vllm_mode="colocate"``, sleep mode, the mixed image batch (four image sizes, four
prompt lengths in every batch) and ``gradient_accumulation_steps=2 > steps_per_generation=1`` (two rollouts per
optimizer step, the second without TRL's sync). During every rollout the engine's ``lm_head`` is compared with the
trainer's current one and with the original checkpoint; the engine's CUDA-graph mode is read from its own config.
Each variant runs in a fresh process:
    on               all fixes (``import trl_vlm_fixes``) but scoring_skip: TRL's scoring pass, timed (every variant)
    scoring_skip_on  all fixes: no scoring pass (its step times against on's)
    off              TRL_VLM_FIXES=0: TRL 1.9.1 as released
    reload_skip_off  TRL_VLM_FIXES_RELOAD_SKIP=0: the batch trains (mm_realign), rollouts show the reload bug
    prompt_parity_off  TRL_VLM_FIXES_PROMPT_PARITY=0: vLLM expands the trainer's expanded image pads again
    sampling_parity_off  TRL_VLM_FIXES_SAMPLING_PARITY=0: TRL's ratio compares vLLM's processed log-probs (after the
                     ban, top-k, top-p) with the trainer's full-vocabulary ones
    graphs_piecewise, graphs_default, graphs_none: the engine's CUDA-graph mode
    PYTHONPATH=.:$SITE python benchmarks/gpu/grpo_end_to_end.py --variants on,off,reload_skip_off --out grpo.json
    PYTHONPATH=.:$SITE python benchmarks/gpu/grpo_end_to_end.py --hidden 2048 --layers 16 \
        --variants on,sampling_parity_off --sampling default,qwen --out sampling.json
Every rollout also records whether the prompt ids vLLM used (``RequestOutput.prompt_token_ids``, which TRL discards)
equal the ids the trainer scores, row for row, how long the generate took, and how long TRL's no-gradient scoring pass
took (the first ``_get_per_token_logps_and_entropies`` of ``_generate_and_score_completions``: TRL's
``old_per_token_logps``, where sampling_parity also computes the processed log-probs; CUDA synchronized around it);
every step TRL's ``sampling/importance_sampling_ratio/{min,mean,max}`` (sequence level: the mean IS weight),
``sampling/sampling_logp_difference/{mean,max}`` and the plugin's ``trl_vlm_fixes/sampling_kept_mass``.
``--sampling``: ``default`` (TRL's: temperature 1, no truncation; the plugin's placeholder ban applies), ``qwen``
(``generation_kwargs`` ``top_p=0.95, top_k=20``, Qwen's recommendation), or a list run as phases of ``--steps`` steps
each in the same process (``default,qwen``: one engine start per variant for both).
``--stand-in`` swaps the engine for the behavioural stand-in (CPU dry run of the script itself, no vLLM engine);
``--tiny`` uses the tests' tiny model shape (with a peaked output layer, see ``common.build_tiny_vlm``).
``--logit-scale S`` multiplies the random model's output layer by S, so that its logits have a trained model's spread
(a random init gives logits of std ~1 over 248,320 tokens: ~12 nats per token, a flat distribution no cut touches);
each variant records the trainer's mean per-token entropy on its first rollout (``entropy_nats``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    RESULT_PREFIX,
    PromptParityRecorder,
    RolloutRecorder,
    build_grpo_trainer,
    engine_additional_config,
    engine_cudagraph_mode,
    engine_gdn_prefill_kernels,
    fix_states,
    print_result,
    use_engine,
    variant_in_fresh_process,
)

# every variant keeps TRL's scoring pass (scoring_skip off), whose time and passes the records read; scoring_skip_on
# runs every fix, that one too (no scoring pass: its step times against on's)
_SCORING_PASS = {"TRL_VLM_FIXES_SCORING_SKIP": "0"}
VARIANT_SWITCHES = {
    "on": {**_SCORING_PASS},
    "off": {"TRL_VLM_FIXES": "0"},
    "reload_skip_off": {"TRL_VLM_FIXES_RELOAD_SKIP": "0", **_SCORING_PASS},
    "prompt_parity_off": {"TRL_VLM_FIXES_PROMPT_PARITY": "0", **_SCORING_PASS},
    "sampling_parity_off": {"TRL_VLM_FIXES_SAMPLING_PARITY": "0", **_SCORING_PASS},
    "graphs_piecewise": {"TRL_VLM_FIXES_CUDAGRAPH_MODE": "PIECEWISE", **_SCORING_PASS},
    "graphs_default": {"TRL_VLM_FIXES_CUDAGRAPH_MODE": "FULL_AND_PIECEWISE", **_SCORING_PASS},
    "graphs_none": {"TRL_VLM_FIXES_CUDAGRAPH_MODE": "NONE", **_SCORING_PASS},
    "scoring_skip_on": {},
}
SAMPLING_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "trl_vlm_fixes/sampling_kept_mass",
)
IS_MEAN, KEPT_MASS = SAMPLING_METRICS[3], SAMPLING_METRICS[5]
# what vLLM is asked to sample with (TRL's generation_kwargs over its own fields)
SAMPLING_SETTINGS: dict[str, dict[str, Any]] = {"default": {}, "qwen": {"top_p": 0.95, "top_k": 20}}


class ScoringRecorder:
    """Wraps the trainer's ``_generate_and_score_completions`` and ``_get_per_token_logps_and_entropies`` (on the
    instance: outermost, every fix inside). Per rollout: its sampling phase (set here, before the rollout, in
    ``VLLMGeneration.generation_kwargs``), its wall time and that of its first no-gradient scoring pass, TRL's
    ``old_per_token_logps`` (the pass sampling_parity extends), CUDA synchronized before and after."""

    def __init__(self, trainer: Any, phases: list[str], steps_per_phase: int) -> None:
        self.trainer, self.phases, self.steps_per_phase = trainer, phases, steps_per_phase
        self.rollouts: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None
        self._phase = phases[0]
        self._rollout = trainer._generate_and_score_completions
        self._score = trainer._get_per_token_logps_and_entropies
        trainer._generate_and_score_completions = self._timed_rollout
        trainer._get_per_token_logps_and_entropies = self._timed_score

    def phase_of_step(self, global_step: int) -> str:
        """The phase of the optimizer step that starts at ``global_step`` (0-based)."""
        return self.phases[min(global_step // self.steps_per_phase, len(self.phases) - 1)]

    @staticmethod
    def _synchronize() -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _timed_rollout(self, *args: Any, **kwargs: Any) -> Any:
        step = self.trainer.state.global_step
        phase = self.phase_of_step(step)
        if phase != self._phase:  # between rollouts the dict is the user's own (the plugin's ban is per generate)
            self.trainer.vllm_generation.generation_kwargs = dict(SAMPLING_SETTINGS[phase])
            self._phase = phase
        record: dict[str, Any] = {"global_step": step, "sampling": phase, "scoring_s": None, "no_grad_passes": 0}
        self._current = record
        self._synchronize()
        started = time.perf_counter()
        try:
            return self._rollout(*args, **kwargs)
        finally:
            self._synchronize()
            record["rollout_s"] = round(time.perf_counter() - started, 4)
            self._current = None
            self.rollouts.append(record)

    def _timed_score(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        record = self._current
        if record is None or torch.is_grad_enabled():
            return self._score(*args, **kwargs)
        self._synchronize()
        started = time.perf_counter()
        result = self._score(*args, **kwargs)
        self._synchronize()
        record["no_grad_passes"] += 1
        if record["scoring_s"] is None:
            record["scoring_s"] = round(time.perf_counter() - started, 5)
        return result


def run_variant(
    model_dir: Path, steps: int, stand_in: bool, phases: list[str], max_completion_length: int = 16
) -> dict[str, Any]:
    """One variant in this process: build the trainer (and its engine), train, and record every rollout."""
    import torch

    use_engine(stand_in)
    result: dict[str, Any] = {"sampling_phases": [{"sampling": p, **SAMPLING_SETTINGS[p]} for p in phases]}
    started = time.perf_counter()
    trainer = build_grpo_trainer(
        model_dir,
        tempfile.mkdtemp(dir=model_dir.parent),
        steps * len(phases),
        stand_in,
        generation_kwargs=SAMPLING_SETTINGS[phases[0]],
        max_completion_length=max_completion_length,
    )
    result["fixes"] = fix_states()
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
    scoring = ScoringRecorder(trainer, phases, steps)
    result["entropy_nats"] = mean_entropy(model, trainer.processing_class)
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
    result["scoring"] = scoring.rollouts
    result["sampling"] = []
    for log in trainer.state.log_history:
        if "loss" not in log:
            continue
        step = int(log.get("step") or 0)
        rollouts = [r for r in scoring.rollouts if r["global_step"] == step - 1 and r["scoring_s"] is not None]
        result["sampling"].append(
            {
                "step": step,
                "sampling": scoring.phase_of_step(max(step - 1, 0)),
                "step_time": log.get("step_time"),
                **{n: log[n] for n in SAMPLING_METRICS if n in log},
                "scoring_s": round(sum(r["scoring_s"] for r in rollouts), 5) if rollouts else None,
                "scoring_s_rollouts": [r["scoring_s"] for r in rollouts],
            }
        )
    result["plugin_metrics"] = [
        {key: value for key, value in log.items() if key.startswith("trl_vlm_fixes/")}
        for log in trainer.state.log_history
        if any(key.startswith("trl_vlm_fixes/") for key in log)
    ]
    result["weights_trained"] = not bool(torch.equal(model.lm_head.weight.detach(), recorder.original))
    return result


def mean_entropy(model: Any, processing_class: Any) -> float:
    """The model's mean next-token entropy (nats) over a short text prompt: how peaked its distribution is."""
    import torch

    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    ids = tokenizer("Describe the picture in one sentence, then count the objects in it.", return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=ids["input_ids"].to(model.device)).logits.float()
    return round(float(torch.distributions.Categorical(logits=logits[0]).entropy().mean()), 3)


def scale_output_layer(model_dir: Path, scale: float) -> None:
    """The checkpoint's output layer times ``scale`` (its logits' spread times ``scale``)."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(model_dir.glob("*.safetensors")):
        weights = load_file(str(shard))
        names = [name for name in weights if name.endswith("lm_head.weight")]
        for name in names:
            weights[name] = weights[name] * scale
        if names:
            save_file(weights, str(shard), metadata={"format": "pt"})


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
        "is_mean": [s.get(IS_MEAN) for s in result.get("sampling", [])],
        "kept_mass": [s.get(KEPT_MASS) for s in result.get("sampling", [])],
        "entropy_nats": result.get("entropy_nats"),
        "scoring_ms": [
            None if s.get("scoring_s") is None else round(1e3 * s["scoring_s"], 2) for s in result.get("sampling", [])
        ],
        "error": result.get("error", ""),
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def scoring_by_phase(result: dict[str, Any]) -> dict[str, float | None]:
    """Per sampling phase, the median per-step scoring time (s) over its steps, the run's first step left out (it
    holds the warm-up)."""
    phases: dict[str, list[float]] = {}
    for logged in result.get("sampling", []):
        if logged.get("scoring_s") is not None and logged["step"] > 1:
            phases.setdefault(logged["sampling"], []).append(logged["scoring_s"])
    return {phase: _median(values) for phase, values in phases.items()}


def sampling_parity_comparison(report: dict[str, Any]) -> dict[str, Any] | None:
    """``on`` against ``sampling_parity_off``, per sampling phase: the mean IS weight and kept share per step, and the
    scoring time the fix adds (median per step, first step left out)."""
    on, off = report["variants"].get("on"), report["variants"].get("sampling_parity_off")
    if not on or not off or not on.get("sampling") or not off.get("sampling"):
        return None
    comparison: dict[str, Any] = {}
    on_scoring, off_scoring = scoring_by_phase(on), scoring_by_phase(off)
    for phase in dict.fromkeys(s["sampling"] for s in on["sampling"]):
        row: dict[str, Any] = {}
        for name, result in (("on", on), ("off", off)):
            steps = [s for s in result["sampling"] if s["sampling"] == phase]
            row[f"is_mean_{name}"] = [s.get(IS_MEAN) for s in steps]
            row[f"is_min_{name}"] = [s.get(SAMPLING_METRICS[2]) for s in steps]
            row[f"logp_difference_mean_{name}"] = [s.get(SAMPLING_METRICS[0]) for s in steps]
            row[f"kept_mass_{name}"] = [s.get(KEPT_MASS) for s in steps]
        row["scoring_s_on"], row["scoring_s_off"] = on_scoring.get(phase), off_scoring.get(phase)
        gaps = [g for g in row["logp_difference_mean_on"] if g is not None]
        row["logp_difference_mean_on_median"] = _median(gaps)
        if row["scoring_s_on"] is not None and row["scoring_s_off"]:
            row["scoring_added_s"] = round(row["scoring_s_on"] - row["scoring_s_off"], 5)
            row["scoring_added_pct"] = round(100 * (row["scoring_s_on"] / row["scoring_s_off"] - 1), 1)
        comparison[phase] = row
    plain, truncated = comparison.get("default"), comparison.get("qwen")
    if plain and truncated and plain["logp_difference_mean_on_median"]:
        # with the fix the gap under truncation is the engine/trainer mismatch alone, as without truncation
        truncated["gap_over_default_on"] = round(
            (truncated["logp_difference_mean_on_median"] or 0.0) / plain["logp_difference_mean_on_median"], 3
        )
    return comparison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="on,off,reload_skip_off")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="grpo_end_to_end.json")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per variant (a hang is a finding too)")
    parser.add_argument("--stand-in", action="store_true", help="CPU dry run with the behavioural stand-in engine")
    parser.add_argument("--hidden", type=int, default=512, help="text hidden size (2048 with --layers 16: ~1.2B)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny shape (hidden 32; CPU dry runs)")
    parser.add_argument(
        "--max-completion-length", type=int, default=16, help="new tokens per rollout (CPU dry runs: 8)"
    )
    parser.add_argument(
        "--sampling",
        default="default",
        help=f"one of {sorted(SAMPLING_SETTINGS)}, or a list run as phases of --steps steps each (default,qwen)",
    )
    parser.add_argument("--logit-scale", type=float, default=1.0, help="output layer x this (a trained spread)")
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    phases = args.sampling.split(",")
    if set(phases) - set(SAMPLING_SETTINGS):
        parser.error(f"--sampling takes {sorted(SAMPLING_SETTINGS)}, alone or as a list")
    if args.one:
        print_result(run_variant(Path(args.model_dir), args.steps, args.stand_in, phases, args.max_completion_length))
        return
    unknown = set(args.variants.split(",")) - set(VARIANT_SWITCHES)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANT_SWITCHES)}")
    from common import build_random_qwen35, build_tiny_vlm

    scratch = tempfile.TemporaryDirectory()  # the model and each variant's output_dir; removed when main returns
    started = time.perf_counter()
    if args.tiny:
        args.hidden, args.layers = 32, 2
        model_dir = build_tiny_vlm(Path(scratch.name) / "model", sharpness=20.0, placeholder_scale=0.0)
    else:
        model_dir = build_random_qwen35(Path(scratch.name) / "model", hidden=args.hidden, layers=args.layers)
    if args.logit_scale != 1.0:
        scale_output_layer(model_dir, args.logit_scale)
    report: dict[str, Any] = {"steps": args.steps, "stand_in": args.stand_in, "hidden": args.hidden, "variants": {}}
    report.update(layers=args.layers, model_build_s=round(time.perf_counter() - started, 1))
    report["logit_scale"] = args.logit_scale
    report["max_completion_length"] = args.max_completion_length
    report["sampling"] = {phase: SAMPLING_SETTINGS[phase] for phase in phases}
    if not args.stand_in:
        from common import versions

        report["versions"] = versions()
    for variant in args.variants.split(","):
        Path(args.out).write_text(json.dumps(report, indent=2))  # the variants done so far outlive a killed call
        arguments = ["--model-dir", str(model_dir), "--steps", str(args.steps)]
        arguments += ["--sampling", args.sampling, "--max-completion-length", str(args.max_completion_length)]
        arguments += ["--stand-in"] if args.stand_in else []
        result, run, error = variant_in_fresh_process(
            __file__, variant, arguments, VARIANT_SWITCHES[variant], args.timeout
        )
        if result is None or run is None:
            report["variants"][variant] = {"trained": False, "error": error}
            continue
        result["log_lines"] = [
            line.strip()[-240:]
            for line in (run.stdout + run.stderr).splitlines()
            if not line.startswith(RESULT_PREFIX)
            and ("GDN prefill kernel" in line or "trl_vlm_fixes:" in line or "trl_vlm_fixes.sampling_parity" in line)
        ][:16]
        report["variants"][variant] = result
        print(json.dumps(summarize(variant, report["variants"][variant])), flush=True)
        print("\n".join(result["log_lines"]), flush=True)
    report["sampling_parity"] = sampling_parity_comparison(report)
    Path(args.out).write_text(json.dumps(report, indent=2))
    header = ("variant", "trained", "steps", "rollouts", "on current", "on original*", "all zero", "reloads", "mode")
    print("".join(f"{h:>16}" for h in header))
    for variant, result in report["variants"].items():
        row = summarize(variant, result)
        cells = [row[k] for k in ("variant", "trained", "steps", "rollouts", "on_current")]
        cells += [row[k] for k in ("on_original_after_training_moved", "all_zero", "disk_reloads", "cudagraph_mode")]
        print("".join(f"{c!s:>16}" for c in cells) + (f"   {row['error'][:120]}" if row["error"] else ""))
    print("* rollouts on the original checkpoint although the trainer's weights had already moved away from it")
    print_sampling_table(report)


def _cell(value: Any, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def print_sampling_table(report: dict[str, Any]) -> None:
    """Per variant and step: the sampling phase, TRL's IS ratio (sequence level) and log-prob gap, the kept share,
    and the no-gradient scoring pass's time; then the fix's added scoring time per phase."""
    header = ("variant", "step", "sampling", "IS min", "IS mean", "IS max", "logp diff", "max", "kept mass", "score ms")
    print("".join(f"{h:>13}" for h in header))
    for variant, result in report["variants"].items():
        for s in result.get("sampling", []):
            cells = [variant[:13], s["step"], s["sampling"]]
            cells += [_cell(s.get(name)) for name in (SAMPLING_METRICS[2], IS_MEAN, SAMPLING_METRICS[4])]
            cells += [_cell(s.get(SAMPLING_METRICS[0])), _cell(s.get(SAMPLING_METRICS[1])), _cell(s.get(KEPT_MASS))]
            cells += [_cell(None if s.get("scoring_s") is None else 1e3 * s["scoring_s"])]
            print("".join(f"{c!s:>13}" for c in cells))
    for phase, row in (report.get("sampling_parity") or {}).items():
        print(
            f"sampling_parity, {phase}: scoring pass per step (median, step 1 left out) {_cell(row['scoring_s_on'])} s"
            f" on vs {_cell(row['scoring_s_off'])} s off ({_cell(row.get('scoring_added_pct'))}%);"
            f" IS mean on {[_cell(v) for v in row['is_mean_on']]}, off {[_cell(v) for v in row['is_mean_off']]};"
            f" per-token gap on {[_cell(v) for v in row['logp_difference_mean_on']]}"
            + (f" ({_cell(row['gap_over_default_on'])} x default's)" if "gap_over_default_on" in row else "")
        )


if __name__ == "__main__":
    main()
