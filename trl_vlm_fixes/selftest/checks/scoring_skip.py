"""``scoring_skip``'s self-test check: TRL's no-gradient scoring pass of each rollout, counted, and what the loss pass
gives in its place (the logged importance-sampling ratio, the loss), on TRL's real GRPOTrainer.

The fix is toggled alone (its switch ``TRL_VLM_FIXES_SCORING_SKIP``): the other fixes stay on both ways, since TRL
1.9.1 scores the mixed image batch away from each row alone without ``mm_realign``, and what is compared is this
fix's change, not theirs. The reward and the log comparison here also serve ``benchmarks/scoring_skip_cost.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..runner import CheckResult, SelftestContext, off_then_on

RATIO = "sampling/importance_sampling_ratio/mean"
TOLERANCE = 1e-5  # TRL's two passes of a row differ at float32 rounding on a mixed image batch (seen: 1e-6)
SWITCH = "TRL_VLM_FIXES_SCORING_SKIP"


def by_row(completions: list[Any], **_: Any) -> list[float]:
    """A reward that differs by row: every group has an advantage signal, so the loss depends on the ratio."""
    return [float(i % 3) for i in range(len(completions))]


@dataclass
class Counted:
    """A trainer's run: its forward calls with gradients disabled (TRL's scoring passes) and its log."""

    no_grad_passes: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [entry[RATIO] for entry in self.log if RATIO in entry]

    def losses(self) -> list[float]:
        """Each step's logged loss, then the run's ``train_loss``."""
        steps = [entry["loss"] for entry in self.log if "loss" in entry]
        return steps + [entry["train_loss"] for entry in self.log if "train_loss" in entry]


def gap(off: list[float], on: list[float]) -> float:
    """The largest difference between two runs' values of the same log entries (inf where they were not logged
    alike)."""
    if not off or len(off) != len(on):
        return float("inf")
    return max(abs(a - b) for a, b in zip(off, on, strict=True))


def count_no_grad_passes(trainer: Any) -> Counted:
    """A forward hook on the trainer's model: each call made with gradients disabled is counted (the rollout's
    scoring pass; the loss pass runs with them)."""
    import torch

    counted = Counted()

    def hook(*_: Any) -> None:
        if not torch.is_grad_enabled():
            counted.no_grad_passes += 1

    trainer.model.register_forward_hook(hook)
    return counted


@contextmanager
def this_fix_alone_off() -> Iterator[None]:
    """Inside ``off_then_on``'s upstream call (every fix reverted): every fix on again but this one, by its switch;
    afterwards every fix reverted again, the switch as it was (``off_then_on`` applies them)."""
    from ... import apply, revert

    saved = os.environ.get(SWITCH)
    os.environ[SWITCH] = "0"
    try:
        apply()
        yield
    finally:
        revert()
        if saved is None:
            del os.environ[SWITCH]
        else:
            os.environ[SWITCH] = saved


def check(context: SelftestContext, family: str) -> CheckResult:
    """Two GRPO steps on the mixed image batch in colocate mode (engine stand-in; aligned steps: 2 micro-batches of a
    generation batch per optimizer step), with the fix off then on: how many no-gradient passes of the trainer's model
    does each make, and are the logged importance-sampling ratio of each step and the loss the same?"""
    from transformers import PrinterCallback

    from ...patches.scoring_skip import scope
    from ...registry import active
    from ..fixtures import MIXED_SAMPLES, build_trainer, mixed_dataset
    from ..rollout_schedule import standin_engine_installed

    aside: list[str | None] = []

    def train() -> Counted | str:
        try:
            with standin_engine_installed():
                trainer = build_trainer(
                    context.model_dir(family),
                    context.processor(family),
                    os.path.join(context.workdir, f"scoring-skip-{family}"),
                    use_vllm=True,
                    vllm_mode="colocate",
                    per_device_train_batch_size=2,
                    gradient_accumulation_steps=2,
                    steps_per_generation=2,
                    max_completion_length=16,
                    max_steps=2,
                    generation_kwargs={"seed": 0},
                    reward_funcs=by_row,
                    dataset=mixed_dataset(MIXED_SAMPLES),
                    disable_tqdm=True,
                )
                trainer.remove_callback(PrinterCallback)  # --json: stdout carries the report alone
                aside.append(scope(trainer))
                counted = count_no_grad_passes(trainer)
                trainer.train()
        except Exception as error:  # noqa: BLE001 - any failure is a verdict here, never a crash
            return f"{type(error).__name__}: {str(error)[:90]}"
        counted.log = list(trainer.state.log_history)
        return counted

    def measure() -> Counted | str:
        if active().is_enabled("scoring_skip"):  # off_then_on's second call: every fix applied
            return train()
        with this_fix_alone_off():
            if active().is_enabled("scoring_skip"):  # trl_vlm_fixes.apply(scoring_skip=True) wins over the switch
                return "the fix could not be turned off alone (an explicit apply() choice keeps it on)"
            return train()

    upstream: list[Counted] = []

    def bug(outcome: Counted | str) -> tuple[bool | None, str]:
        if isinstance(outcome, str):
            return None, f"fix off: {outcome}"
        upstream.append(outcome)
        return outcome.no_grad_passes > 0, (
            f"fix off: {outcome.no_grad_passes} no-gradient passes of the trainer's model in 2 steps"
        )

    def fix(outcome: Counted | str) -> tuple[bool | None, str]:
        if isinstance(outcome, str):
            return None, f"fix on: {outcome}"
        if aside and aside[-1]:
            return None, f"fix on: steps aside ({aside[-1]})"
        if not upstream:
            return None, f"fix on: {outcome.no_grad_passes} no-gradient passes (nothing to compare: the run off failed)"
        off = upstream[0]
        ratio_gap, loss_gap = gap(off.ratios(), outcome.ratios()), gap(off.losses(), outcome.losses())
        ok = outcome.no_grad_passes == 0 and ratio_gap <= TOLERANCE and loss_gap <= TOLERANCE
        return ok, (
            f"fix on: {outcome.no_grad_passes} no-gradient passes; each step's mean importance-sampling ratio "
            f"({len(outcome.ratios())}/{len(off.ratios())} logged) within {ratio_gap:.1e} of the fix off's, its loss "
            f"and train_loss within {loss_gap:.1e}"
        )

    return off_then_on("scoring_skip", measure, bug, fix)
