"""``python -m trl_vlm_fixes selftest``: show each bug and each fix on the installed stack, in under a minute on a CPU.

Tiny random Qwen3.5 VLMs, dense and MoE, are built offline in a temporary folder. Each fix names its check
(``Fix.selftest``, ``"module:function"``: its module in ``checks/``), resolved here when the self-test runs
(``resolve_check``); each runs for both families, once with the fixes reverted (upstream behaviour:
is the bug present here?) and once with them applied (does the fix work here?). ``only`` runs the named checks alone.

Quiet unless ``verbose``: what the libraries write while the checks run (weight-loading progress bars, their
warnings, the tiny runs' own log lines) is held back and shown only if the self-test itself crashes, so the table is
the first thing printed. One OpenMP thread unless ``OMP_NUM_THREADS`` says otherwise: the tiny models gain nothing
from more, and on a busy 2-core machine torch's default (a thread per core) made the self-test 183 s instead of 32 s.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

FAMILIES = ("qwen3_5", "qwen3_5_moe")  # the models users train: Qwen3.5, dense and mixture-of-experts
# why a fix declares no check (a fix without one and without a reason here is reported as declaring none)
NOT_CHECKED = {
    "watchdog": "it acts only on a wedged engine or call, after at least its 10 s limit, by ending the process it "
    "watches (exit 75); its evidence: docs/fixes/watchdog.md#evidence",
}


class UnknownCheckError(ValueError):
    """``only`` names something that is not a fix with a self-test check."""


class CheckReferenceError(LookupError):
    """A fix's ``selftest`` reference names no function that can be called (module missing, attribute missing, or
    not callable)."""


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
    from .. import apply, revert
    from ..registry import WRAPPED_STATES, active

    started = time.perf_counter()
    revert()
    try:
        bug_present, bug_detail = judge_bug(measure())
    finally:
        apply()
    state, _ = active().fix_state(name)
    fix_works: bool | None = None
    fix_detail = f"fix {state}"
    if state in WRAPPED_STATES:  # stepped aside for the last trainer built, not for this measurement
        fix_works, fix_detail = judge_fix(measure())
    elif state == "not-needed":
        fix_works, fix_detail = not bug_present, "upstream solved it; the fix steps aside"
    return CheckResult(state, bug_present, fix_works, time.perf_counter() - started, f"{bug_detail}; {fix_detail}")


def not_checked() -> dict[str, str]:
    """Every fix that declares no check, with the reason (no torch, TRL or vLLM imported)."""
    from ..registry import active

    return {
        name: NOT_CHECKED.get(name, "it declares no check (Fix.selftest)")
        for name, fix in active().fixes.items()
        if fix.selftest is None
    }


def resolve_check(name: str) -> Callable[[SelftestContext, str], CheckResult]:
    """The function the fix ``name`` declares as its check (``Fix.selftest``, ``"module:function"``), imported now:
    ``CheckReferenceError`` naming the fix, its reference and what is missing where it does not resolve."""
    from ..registry import active

    reference = active().fixes[name].selftest
    if reference is None:
        raise CheckReferenceError(f"fix {name} declares no self-test check (Fix.selftest)")
    module_name, _, attribute = reference.partition(":")
    where = f"fix {name}'s self-test check {reference!r} does not resolve"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not (module_name == error.name or module_name.startswith(error.name + ".")):
            raise  # the check's module exists, and something it imports is missing: that error is the news
        raise CheckReferenceError(f"{where}: no module {error.name!r}") from error
    check = getattr(module, attribute, None)
    if check is None:
        raise CheckReferenceError(f"{where}: module {module_name!r} has no {attribute!r}")
    if not callable(check):
        raise CheckReferenceError(f"{where}: {attribute!r} is a {type(check).__name__}, not a function")
    return check


def selected(only: list[str] | None) -> list[str]:
    """The checks to run, in report order: every declared one, or those ``only`` names (``UnknownCheckError``
    naming the valid names otherwise). No torch, TRL or vLLM imported."""
    from ..registry import active

    checks = [name for name, fix in active().fixes.items() if fix.selftest is not None]
    if only is None:
        return checks
    unknown = [name for name in only if name not in checks]
    if unknown or not only:
        why = "; ".join(f"{name}: {reason}" for name, reason in not_checked().items() if name in unknown)
        raise UnknownCheckError(
            f"no self-test check named {', '.join(unknown) or '(none given)'}"
            + (f" ({why})" if why else "")
            + f"; valid names: {', '.join(checks)}"
        )
    return [name for name in checks if name in only]


def collect(only: list[str] | None = None, progress: IO[str] | None = None) -> dict[str, Any]:
    """Run the checks (all, or those ``only`` names), writing a line per finished check to ``progress``."""
    from .. import __version__
    from ..registry import active
    from ..status import build_status

    registry = active()
    names = selected(only)
    resolved = {name: resolve_check(name) for name in names}  # every reference before minutes of work
    registry.import_targets()
    started = time.perf_counter()
    checks: dict[str, CheckResult] = {}
    registry.scopes_paused = True  # its tiny trainers are not the user's: what the fixes act on stays as it was
    try:
        with tempfile.TemporaryDirectory(prefix="trl_vlm_fixes_selftest_", ignore_cleanup_errors=True) as workdir:
            context = SelftestContext(workdir)
            for name, check in resolved.items():
                checks[name] = _over_families([check(context, family) for family in FAMILIES])
                if progress is not None:
                    print(f"trl_vlm_fixes selftest: {name} done in {checks[name].seconds:.1f} s", file=progress)
    finally:
        registry.scopes_paused = False
    failed = [name for name, check in checks.items() if check.fix_works is False]
    status = build_status(registry, __version__)
    skipped = {name: "not run (--only)" for name in selected(None) if name not in names}
    return {
        "version": __version__,
        "versions": status["versions"],
        "families": list(FAMILIES),
        "fixes": {name: asdict(check) for name, check in checks.items()},
        "not_checked": {name: reason for name in registry.fixes if (reason := {**not_checked(), **skipped}.get(name))},
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
    for name, reason in report.get("not_checked", {}).items():
        lines.append(f"{name:<18} not checked: {reason}")
    verdict = (
        "OK: every enabled fix checked works on this stack"
        if report["verdict"] == "ok"
        else (f"FAIL: {', '.join(report['failed'])} did not work on this stack")
    )
    lines += ["", f"{verdict} ({report['seconds']} s)"]
    return "\n".join(lines)


@contextmanager
def one_thread() -> Iterator[None]:
    """One OpenMP thread for the checks, unless ``OMP_NUM_THREADS`` is set (read by torch when it is imported; set
    on torch directly where it already is, and put back afterwards)."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]
        if torch is not None and threads is not None:
            torch.set_num_threads(threads)


@contextmanager
def held_back_output() -> Iterator[Callable[[str], None]]:
    """What the libraries write to stdout or stderr meanwhile (at the file-descriptor level: tqdm bars, C++ warnings,
    print calls) goes to a temporary file, shown on stderr if the block raises, or when the block asks for it (the
    function it gets, with the reason: a check that could not measure must not hide why)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams = (sys.stdout, sys.stderr)
    shown: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as held:
        # Python's own streams too: one a test harness or a notebook put there may not write to fds 1 and 2
        into_held = os.fdopen(os.dup(held.fileno()), "w", buffering=1, errors="replace")
        try:
            for fd in saved:
                os.dup2(held.fileno(), fd)
            sys.stdout = sys.stderr = into_held
            yield shown.append
        except BaseException:
            sys.stdout, sys.stderr = streams
            _restore(saved)
            into_held.flush()
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            sys.stdout, sys.stderr = streams
            _restore(saved)
            into_held.close()
        if shown:
            held.seek(0)
            sys.stderr.write(f"trl_vlm_fixes selftest: {shown[0]}; what the libraries wrote meanwhile:\n")
            sys.stderr.write(held.read().decode(errors="replace"))


def _restore(saved: dict[int, int]) -> None:
    for stream in (sys.stdout, sys.stderr):
        with suppress(ValueError):  # closed meanwhile
            stream.flush()
    for fd, original in list(saved.items()):
        os.dup2(original, fd)
        os.close(original)
        del saved[fd]


def run_selftest(as_json: bool = False, only: list[str] | None = None, verbose: bool = False) -> int:
    """The CLI's ``selftest``: 0 when every enabled fix checked works, 1 when one does not, 2 for an unknown name."""
    try:
        selected(only)
    except UnknownCheckError as error:
        print(f"trl_vlm_fixes selftest: {error}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if verbose:  # everything the libraries and the tiny runs say, as they say it, and a line per check
        with one_thread():
            report = collect(only, progress=sys.stderr)
    else:
        report = _quiet_collect(only)
    print(json.dumps(report, indent=2) if as_json else render(report))
    return 0 if report["verdict"] == "ok" else 1


def _quiet_collect(only: list[str] | None) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    quiet = ("transformers", "trl", "accelerate", "datasets", "torch", "vllm")
    levels = {name: logging.getLogger(name).level for name in (*quiet, "trl_vlm_fixes")}
    for name in quiet:
        logging.getLogger(name).setLevel(logging.ERROR)
    # the engine and trainer lines of the self-test's own tiny runs are not news
    logging.getLogger("trl_vlm_fixes").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), one_thread(), held_back_output() as show:
            warnings.simplefilter("ignore")
            report = collect(only)
            # a measurement that raised becomes "n/a" with the exception's name in its detail: never hide its output
            crashed = [
                name
                for name, check in report["fixes"].items()
                if check["fix_works"] is None and ("Error" in check["detail"] or "Exception" in check["detail"])
            ]
            if crashed:
                show(f"a check's measurement raised ({', '.join(crashed)})")
            return report
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
