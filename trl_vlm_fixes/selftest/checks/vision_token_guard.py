"""``vision_token_guard``'s self-test check: a placeholder-loving policy's rollout, scored."""

from __future__ import annotations

from ...patches.vision_token_guard import placeholder_tokens
from ..runner import CheckResult, SelftestContext, off_then_on


def check(context: SelftestContext, family: str) -> CheckResult:
    """A policy that loves its placeholders (lm_head rows scaled): its rollout crashes scoring upstream."""
    import torch

    from ..batch_scoring import score_batch
    from ..fixtures import mixed_rows

    trainer = context.trainer(family, "loving")
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

    return off_then_on("vision_token_guard", measure, bug, fix)
