"""``mm_realign``'s self-test check: the mixed image batch scored in two orders against each row alone."""

from __future__ import annotations

from typing import Any

from ..runner import CheckResult, SelftestContext, off_then_on

CRASHING_ORDER = (0, 1, 2, 3)
SILENT_ORDER = (3, 2, 1, 0)
INVARIANCE_TOLERANCE = 1e-5


def check(context: SelftestContext, family: str) -> CheckResult:
    """The mixed image batch (four image sizes, four prompt lengths) scored in two orders: it crashes or is scored
    away from each row alone upstream; with the fix every row gets what it gets alone."""
    from ..batch_scoring import max_batch_vs_alone_gap
    from ..fixtures import mixed_rows

    trainer, processor = context.trainer(family), context.processor(family)
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

    return off_then_on("mm_realign", measure, bug, fix)
