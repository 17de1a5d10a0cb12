"""``sampling_parity``'s self-test check: TRL's importance-sampling weight after one GRPO step with top_k=5."""

from __future__ import annotations

from ...patches.sampling_parity import SAMPLING_KEPT_MASS
from ..runner import CheckResult, SelftestContext, off_then_on


def check(context: SelftestContext, family: str) -> CheckResult:
    """One GRPO step in colocate mode on the engine stand-in, which samples through vLLM's own Sampler with top_k=5
    from the trainer's own weights: TRL's importance-sampling weight of each completion, upstream and with the fix."""
    import os

    from transformers import PrinterCallback

    from ..fixtures import build_trainer, text_dataset
    from ..rollout_schedule import standin_engine_installed

    def measure() -> dict[str, float] | str:
        try:
            with standin_engine_installed():
                trainer = build_trainer(
                    context.model_dir(family),
                    context.processor(family),
                    os.path.join(context.workdir, f"sampling-{family}"),
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
        kept = outcome.get(SAMPLING_KEPT_MASS.name, float("nan"))
        return abs(weight(outcome) - 1.0) < 1e-5, f"fix on: {weight(outcome):.6f} (kept share per token {kept:.2f})"

    return off_then_on("sampling_parity", measure, bug, fix)
