"""``python -m trl_vlm_fixes selftest``: show each bug and each fix on the installed stack, in under a minute on a CPU.

Tiny random Qwen3.5 VLMs, dense and MoE, are built offline in a temporary folder. Each fix declares its check
(``Fix.selftest``, in its own module); each runs for both families, once with the fixes reverted (upstream behaviour:
is the bug present here?) and once with them applied (does the fix work here?).
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

FAMILIES = ("qwen3_5", "qwen3_5_moe")  # the models users train: Qwen3.5, dense and mixture-of-experts


@dataclass
class CheckResult:
    state: str
    bug_present: bool | None
    fix_works: bool | None
    seconds: float
    detail: str


class SelftestContext:
    """What the checks share: a tiny checkpoint, its processor and a GRPO trainer per family, built once, lazily."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self._models: dict[str, Path] = {}
        self._processors: dict[str, Any] = {}
        self._trainers: dict[tuple[str, str], Any] = {}

    def model_dir(self, family: str) -> Path:
        if family not in self._models:
            from .tiny_model import build_tiny_qwen35_vlm

            self._models[family] = build_tiny_qwen35_vlm(os.path.join(self.workdir, f"tiny-{family}"), family=family)
        return self._models[family]

    def processor(self, family: str) -> Any:
        if family not in self._processors:
            from transformers import AutoProcessor

            self._processors[family] = AutoProcessor.from_pretrained(self.model_dir(family))
        return self._processors[family]

    def trainer(self, family: str, label: str = "out") -> Any:
        """A GRPOTrainer on the family's tiny model (one per label: a check that changes its weights has its own)."""
        if (family, label) not in self._trainers:
            from .fixtures import build_trainer

            directory = os.path.join(self.workdir, f"{family}-{label}")
            trainer = build_trainer(self.model_dir(family), self.processor(family), directory, disable_tqdm=True)
            self._trainers[(family, label)] = trainer
        return self._trainers[(family, label)]


def off_then_on(
    name: str,
    measure: Callable[[], Any],
    judge_bug: Callable[[Any], tuple[bool | None, str]],
    judge_fix: Callable[[Any], tuple[bool | None, str]],
) -> CheckResult:
    from .. import REGISTRY, apply, revert
    from ..registry import WRAPPED_STATES

    started = time.perf_counter()
    revert()
    try:
        bug_present, bug_detail = judge_bug(measure())
    finally:
        apply()
    state, _ = REGISTRY.fix_state(name)
    fix_works: bool | None = None
    fix_detail = f"fix {state}"
    if state in WRAPPED_STATES:  # stepped aside for the last trainer built, not for this measurement
        fix_works, fix_detail = judge_fix(measure())
    elif state == "not-needed":
        fix_works, fix_detail = not bug_present, "upstream solved it; the fix steps aside"
    return CheckResult(state, bug_present, fix_works, time.perf_counter() - started, f"{bug_detail}; {fix_detail}")


def collect() -> dict[str, Any]:
    from .. import REGISTRY, __version__
    from ..status import build_status

    REGISTRY.import_targets()
    started = time.perf_counter()
    checks: dict[str, CheckResult] = {}
    REGISTRY.scopes_paused = True  # its tiny trainers are not the user's: what the fixes act on stays as it was
    try:
        with tempfile.TemporaryDirectory(prefix="trl_vlm_fixes_selftest_", ignore_cleanup_errors=True) as workdir:
            context = SelftestContext(workdir)
            for name, fix in REGISTRY.fixes.items():
                if fix.selftest is not None:
                    checks[name] = _over_families([fix.selftest(context, family) for family in FAMILIES])
    finally:
        REGISTRY.scopes_paused = False
    failed = [name for name, check in checks.items() if check.fix_works is False]
    status = build_status(REGISTRY, __version__)
    return {
        "version": __version__,
        "versions": status["versions"],
        "families": list(FAMILIES),
        "fixes": {name: asdict(check) for name, check in checks.items()},
        "verdict": "fail" if failed else "ok",
        "failed": failed,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _over_families(results: list[CheckResult]) -> CheckResult:
    """One verdict over the families that the check applies to (None: not for that family): a failure in any
    family fails; n/a only where it applies to none."""

    def every(values: list[bool | None]) -> bool | None:
        known = [value for value in values if value is not None]
        return all(known) if known else None

    return CheckResult(
        results[0].state,
        every([r.bug_present for r in results]),
        every([r.fix_works for r in results]),
        sum(r.seconds for r in results),
        " | ".join(f"{family}: {r.detail}" for family, r in zip(FAMILIES, results, strict=True)),
    )


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
