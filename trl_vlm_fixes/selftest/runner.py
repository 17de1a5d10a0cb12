"""``python -m trl_vlm_fixes selftest``: show each bug and each fix on the installed stack, in under a minute on a CPU.

A tiny random Qwen3.5 VLM is built offline in a temporary folder. Each check runs once with the fixes reverted
(upstream behaviour: is the bug present here?) and once with them applied (does the fix work here?).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LOGGER = logging.getLogger("trl_vlm_fixes")

CRASHING_ORDER = (0, 1, 2, 3)
SILENT_ORDER = (3, 2, 1, 0)
INVARIANCE_TOLERANCE = 1e-5


@dataclass
class CheckResult:
    state: str
    bug_present: bool | None
    fix_works: bool | None
    seconds: float
    detail: str


def _off_then_on(
    name: str,
    measure: Callable[[], Any],
    judge_bug: Callable[[Any], tuple[bool | None, str]],
    judge_fix: Callable[[Any], tuple[bool | None, str]],
) -> CheckResult:
    from .. import REGISTRY, apply, revert

    started = time.perf_counter()
    revert()
    try:
        bug_present, bug_detail = judge_bug(measure())
    finally:
        apply()
    state, _ = REGISTRY.fix_state(name)
    fix_works: bool | None = None
    fix_detail = f"fix {state}"
    if state == "applied":
        fix_works, fix_detail = judge_fix(measure())
    elif state == "not-needed":
        fix_works, fix_detail = not bug_present, "upstream solved it; the fix steps aside"
    return CheckResult(state, bug_present, fix_works, time.perf_counter() - started, f"{bug_detail}; {fix_detail}")


def check_mm_realign(trainer: Any, processor: Any) -> CheckResult:
    from .batch_scoring import max_batch_vs_alone_gap
    from .fixtures import mixed_rows

    rows = mixed_rows()

    def measure() -> dict[str, Any]:
        outcome: dict[str, Any] = {}
        for label, order in (("crashing", CRASHING_ORDER), ("silent", SILENT_ORDER)):
            try:
                outcome[label] = max_batch_vs_alone_gap(trainer, processor, [rows[i] for i in order])
            except Exception as error:  # noqa: BLE001 - any failure is a verdict here, never a crash
                outcome[label] = f"{type(error).__name__}: {str(error)[:90]}"
        return outcome

    def describe(outcome: dict[str, Any]) -> str:
        return ", ".join(
            f"{label} batch {value if isinstance(value, str) else f'log-probs off by {value:.1e} from each row alone'}"
            for label, value in outcome.items()
        )

    def bug(outcome: dict[str, Any]) -> tuple[bool, str]:
        wrong = [v for v in outcome.values() if isinstance(v, str) or v > 1e-3]
        return bool(wrong), f"fix off: {describe(outcome)}"

    def fix(outcome: dict[str, Any]) -> tuple[bool, str]:
        ok = all(isinstance(v, float) and v <= INVARIANCE_TOLERANCE for v in outcome.values())
        return ok, f"fix on: {describe(outcome)}"

    return _off_then_on("mm_realign", measure, bug, fix)


def check_prompt_parity(model_dir: Path, processor: Any) -> CheckResult:
    """Two image prompts through TRL's VLLMGeneration to the engine stand-in, whose prompts go through vLLM's own
    multimodal processor: how many rows does the engine sample from another prompt than the trainer's?"""
    from .fixtures import conversation, make_image
    from .rollout_schedule import build_generation

    images = [make_image(96, 64, 0), make_image(128, 96, 1)]
    prompts = []
    for image in images:
        messages = conversation("what is this?")
        messages[0]["content"][0]["image"] = image
        tokenized = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        prompts.append(list(tokenized["input_ids"][0]))

    def measure() -> tuple[int, str | None]:
        generation = build_generation(model_dir, processor, enable_sleep_mode=False)
        generation.generate(prompts=prompts, images=[[image] for image in images], num_generations=1)
        engine = generation.llm
        return sum(a != b for a, b in zip(engine.prompts_seen, prompts, strict=True)), engine.mm_processing

    def unavailable(processing: str | None) -> str | None:
        return None if processing == "vllm" else f"vLLM's multimodal processor is unavailable here ({processing})"

    def bug(outcome: tuple[int, str | None]) -> tuple[bool | None, str]:
        differing, processing = outcome
        if reason := unavailable(processing):
            return None, reason
        return differing > 0, f"fix off: vLLM samples {differing}/{len(prompts)} image rows from another prompt"

    def fix(outcome: tuple[int, str | None]) -> tuple[bool | None, str]:
        differing, processing = outcome
        if reason := unavailable(processing):
            return None, reason
        return differing == 0, f"fix on: {len(prompts) - differing}/{len(prompts)} rows identical to the trainer's"

    return _off_then_on("prompt_parity", measure, bug, fix)


def check_sampling_parity(model_dir: Path, processor: Any, workdir: str) -> CheckResult:
    """One GRPO step in colocate mode on the engine stand-in, which samples through vLLM's own Sampler with top_k=5
    from the trainer's own weights: TRL's importance-sampling weight of each completion, upstream and with the fix."""
    from transformers import PrinterCallback

    from .fixtures import build_trainer, text_dataset
    from .rollout_schedule import standin_engine_installed

    def measure() -> dict[str, float] | str:
        try:
            with standin_engine_installed():
                trainer = build_trainer(
                    model_dir,
                    processor,
                    os.path.join(workdir, "sampling"),
                    use_vllm=True,
                    vllm_mode="colocate",
                    max_steps=1,
                    max_completion_length=16,
                    generation_kwargs={"top_k": 5, "seed": 0},
                    disable_tqdm=True,
                    dataset=text_dataset(),  # equal-length prompts: no other fix is needed to score them
                )
                trainer.remove_callback(PrinterCallback)  # --json: stdout carries the report alone
                trainer.train()
        except ImportError as error:  # no vLLM here: nothing samples as vLLM does
            return f"vLLM's Sampler is not importable here ({error})"
        except Exception as error:  # noqa: BLE001 - any failure is a verdict here, never a crash
            return f"{type(error).__name__}: {str(error)[:90]}"
        return next(log for log in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in log)

    def weight(outcome: dict[str, float]) -> float:
        return outcome["sampling/importance_sampling_ratio/mean"]

    def bug(outcome: dict[str, float] | str) -> tuple[bool | None, str]:
        if isinstance(outcome, str):
            return None, outcome
        return weight(outcome) < 0.9, f"fix off: top_k=5 gives a mean importance weight of {weight(outcome):.3g}"

    def fix(outcome: dict[str, float] | str) -> tuple[bool | None, str]:
        if isinstance(outcome, str):
            return None, outcome
        kept = outcome.get("trl_vlm_fixes/sampling_kept_mass", float("nan"))
        return abs(weight(outcome) - 1.0) < 1e-5, f"fix on: {weight(outcome):.6f} (kept share per token {kept:.2f})"

    return _off_then_on("sampling_parity", measure, bug, fix)


def check_reload_skip(model_dir: Path, processor: Any) -> CheckResult:
    from .rollout_schedule import TrainerLoop, build_generation, run_schedule

    def measure() -> TrainerLoop:
        loop = TrainerLoop(build_generation(model_dir, processor))
        run_schedule(loop)
        return loop

    def bug(loop: TrainerLoop) -> tuple[bool, str]:
        detail = (
            f"fix off: {loop.stale}/{loop.generates} rollouts on stale or garbage weights, "
            f"{loop.engine.disk_reloads} disk reloads"
        )
        return loop.stale > 0, detail

    def fix(loop: TrainerLoop) -> tuple[bool, str]:
        ok = loop.stale == 0 and loop.engine.disk_reloads == 0 and loop.max_full_pushes_per_generate <= 1
        return ok, (
            f"fix on: {loop.generates - loop.stale}/{loop.generates} rollouts on current weights, "
            f"{loop.engine.disk_reloads} disk reloads"
        )

    return _off_then_on("reload_skip", measure, bug, fix)


def check_gdn_prefill(model_dir: Path, processor: Any) -> CheckResult:
    """Which Gated-DeltaNet prefill kernel the engine TRL builds is asked for, where the kernel that hangs exists."""
    from ..patches.gdn_prefill import kernel_gone, selected_backend
    from ..vllm_arguments import engine_argument_problem
    from .rollout_schedule import build_generation

    def measure() -> Any:
        return build_generation(model_dir, processor).llm.init_kwargs.get("gdn_prefill_backend")

    def bug(backend: Any) -> tuple[bool, str]:
        if gone := kernel_gone():
            return False, f"fix off: gdn_prefill_backend={backend}, no kernel to avoid (installed versions: {gone})"
        return backend is None, (
            f"fix off: gdn_prefill_backend={backend} (vLLM 0.25.1 then picks FlashInfer's SM90 kernel on Hopper)"
        )

    def fix(backend: Any) -> tuple[bool, str]:
        problem = engine_argument_problem("gdn_prefill_backend", backend)
        detail = f"fix on: gdn_prefill_backend={backend}" + (f" ({problem})" if problem else "")
        return backend == selected_backend() and problem is None, detail

    return _off_then_on("gdn_prefill", measure, bug, fix)


def check_vision_token_guard(trainer: Any) -> CheckResult:
    """A policy that loves its placeholders (lm_head rows scaled): its rollout crashes scoring upstream."""
    import torch

    from ..patches.vision_token_guard import placeholder_tokens
    from .batch_scoring import score_batch
    from .fixtures import mixed_rows

    banned = set(placeholder_tokens(trainer))
    with torch.no_grad():
        trainer.model.lm_head.weight[sorted(banned)] *= 50.0
    rows = mixed_rows(((96, 64, "cats"), (96, 64, "dogs")))  # equal lengths: this check needs no realign

    def measure() -> str | int:
        torch.manual_seed(0)
        try:
            out, _ = score_batch(trainer, rows)
        except Exception as error:  # noqa: BLE001 - any failure is a verdict here, never a crash
            return f"{type(error).__name__}: {str(error)[:80]}"
        return sum(bool(banned & set(row.tolist())) for row in out["completion_ids"])

    def bug(outcome: str | int) -> tuple[bool, str]:
        return isinstance(outcome, str) or outcome > 0, f"fix off: a placeholder-loving policy's rollout: {outcome}"

    def fix(outcome: str | int) -> tuple[bool, str]:
        return outcome == 0, f"fix on: scored, {outcome} completions holding a placeholder"

    return _off_then_on("vision_token_guard", measure, bug, fix)


def engine_cudagraph_mode(config: Any) -> str:
    """The CUDA-graph mode an engine given ``compilation_config=config`` runs, as vLLM's own config resolves it."""
    try:
        from vllm.config import CompilationConfig
    except ImportError:
        mode = (config or {}).get("cudagraph_mode") if isinstance(config, dict) else None
        return str(mode or "vLLM default (graphs on)")
    resolved = CompilationConfig(**config) if isinstance(config, dict) else (config or CompilationConfig())
    # None: VllmConfig picks its default, FULL_AND_PIECEWISE on a GPU (measured on an H200, docs/gpu-results.md)
    return resolved.cudagraph_mode.name if resolved.cudagraph_mode is not None else "vLLM default (graphs on)"


def check_cudagraph(model_dir: Path, processor: Any) -> CheckResult:
    """The CUDA-graph mode the engine TRL builds for a Gated-DeltaNet model gets, as vLLM's CompilationConfig reads it:
    upstream vLLM's default graphs (GDN decode captured), with the fix one that captures no GDN kernel."""
    from ..patches.cudagraph import selected_mode
    from .rollout_schedule import build_generation

    def measure() -> str:
        return engine_cudagraph_mode(build_generation(model_dir, processor).llm.init_kwargs.get("compilation_config"))

    def bug(mode: str) -> tuple[bool | None, str]:
        captured = mode not in ("NONE", "PIECEWISE")
        return captured, f"fix off: the engine TRL builds for a Gated-DeltaNet model gets cudagraph_mode={mode}"

    def fix(mode: str) -> tuple[bool | None, str]:
        return mode == selected_mode(), f"fix on: vLLM's CompilationConfig gets cudagraph_mode={mode}"

    return _off_then_on("cudagraph", measure, bug, fix)


def collect() -> dict[str, Any]:
    from .. import REGISTRY, __version__
    from ..status import build_status

    REGISTRY.import_targets()
    started = time.perf_counter()
    from transformers import AutoProcessor

    from .fixtures import build_trainer
    from .tiny_model import build_tiny_qwen35_vlm

    with tempfile.TemporaryDirectory(prefix="trl_vlm_fixes_selftest_", ignore_cleanup_errors=True) as workdir:
        model_dir = build_tiny_qwen35_vlm(os.path.join(workdir, "tiny-qwen35-vlm"))
        processor = AutoProcessor.from_pretrained(model_dir)
        trainer = build_trainer(model_dir, processor, os.path.join(workdir, "out"), disable_tqdm=True)
        checks = {
            "mm_realign": check_mm_realign(trainer, processor),
            "prompt_parity": check_prompt_parity(model_dir, processor),
            "sampling_parity": check_sampling_parity(model_dir, processor, workdir),
            "reload_skip": check_reload_skip(model_dir, processor),
            "cudagraph": check_cudagraph(model_dir, processor),
            "gdn_prefill": check_gdn_prefill(model_dir, processor),
            "vision_token_guard": check_vision_token_guard(
                build_trainer(model_dir, processor, os.path.join(workdir, "loving"), disable_tqdm=True)
            ),
        }
    failed = [name for name, check in checks.items() if check.fix_works is False]
    status = build_status(REGISTRY, __version__)
    return {
        "version": __version__,
        "versions": status["versions"],
        "fixes": {name: asdict(check) for name, check in checks.items()},
        "verdict": "fail" if failed else "ok",
        "failed": failed,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _yes_no(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "no")


def render(report: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {v or '-'}" for k, v in report["versions"].items())
    lines = [f"trl_vlm_fixes {report['version']} self-test on {versions}", ""]
    for name, check in report["fixes"].items():
        lines.append(
            f"{name:<18} bug present: {_yes_no(check['bug_present']):<4} fix works: "
            f"{_yes_no(check['fix_works']):<4} ({check['state']}) {check['seconds']:5.1f} s  {check['detail']}"
        )
    verdict = (
        "OK: every enabled fix works on this stack"
        if report["verdict"] == "ok"
        else (f"FAIL: {', '.join(report['failed'])} did not work on this stack")
    )
    lines += ["", f"{verdict} ({report['seconds']} s)"]
    return "\n".join(lines)


def run_selftest(as_json: bool = False) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet = ("transformers", "trl", "accelerate", "datasets", "torch")
    for name in quiet:
        logging.getLogger(name).setLevel(logging.ERROR)
    own = logging.getLogger("trl_vlm_fixes")
    level = own.level
    own.setLevel(logging.ERROR)  # the engine and trainer lines of the self-test's own tiny runs are not news
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = collect()
    finally:
        own.setLevel(level)
    print(json.dumps(report, indent=2) if as_json else render(report))
    return 0 if report["verdict"] == "ok" else 1
