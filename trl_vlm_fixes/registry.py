"""Apply and revert fixes in place with wrapt, attaching each one when its target module is imported.

Modelled on ddtrace's ``_monkey`` and OpenTelemetry's instrumentors: post-import hooks make import order irrelevant,
each wrapper sits on the class that defines the method (so subclasses inherit it), and revert puts back the exact
original objects. A hook never breaks the user's import unless strict mode asked for that.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from .switches import fix_enabled, fix_switch, strict_mode, validate_environment
from .versions import version_drift

LOGGER = logging.getLogger("trl_vlm_fixes")

WrapperFunction = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
TargetCheck = Callable[[Callable[..., Any]], "str | None"]


class FixNotApplicableError(RuntimeError):
    """Raised instead of a warning when TRL_VLM_FIXES_STRICT=1 and an enabled fix cannot be applied."""


_registries: list[Registry] = []


def report_runtime_state(fix_name: str, target_key: str, state: str, detail: str) -> None:
    """A wrapper found at run time that its fix did not act (e.g. nothing reached ``LLM(...)``): status says so."""
    for registry in _registries:
        registry.set_state(fix_name, target_key, state, detail)


def _no_problem(function: Callable[..., Any]) -> str | None:
    return None


@dataclass(frozen=True)
class Target:
    """One method to wrap: ``qualname`` is ``Class.method`` inside ``module``."""

    module: str
    qualname: str
    wrapper: WrapperFunction
    required_parameters: tuple[str, ...] = ()
    # Returns why the method no longer has the shape the wrapper relies on, or None.
    shape_problem: TargetCheck = _no_problem
    # Returns why upstream already solved the bug (the fix then steps aside), or None.
    upstream_fixed: TargetCheck = _no_problem
    # Experimental modules may be absent from other TRL releases: their absence is not a skip.
    optional: bool = False

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


# The trainers whose VLM rollouts the fixes serve: (module, class)
TRAINERS = (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))


def on_trainers(wrappers: dict[str, WrapperFunction], **options: Any) -> tuple[Target, ...]:
    """The same wrappers (method name -> wrapper) on every class of ``TRAINERS``, in that order."""
    return tuple(
        Target(module, f"{cls}.{method}", wrapper, **options)
        for module, cls in TRAINERS
        for method, wrapper in wrappers.items()
    )


@dataclass(frozen=True)
class Fix:
    """One fix as every module of ``patches/`` declares it: ``FIX = Fix(name, summary, packages, targets)``."""

    name: str
    summary: str
    packages: tuple[str, ...]  # whose validated versions the fix was proven on (a drift warns)
    targets: tuple[Target, ...]

    @property
    def switch(self) -> str:
        return fix_switch(self.name)


@dataclass
class _Patched:
    owner: type
    attribute: str
    original: Any
    wrapper: Any


@dataclass
class _FixRecord:
    enabled: bool = False
    targets: dict[str, tuple[str, str]] = field(default_factory=dict)  # target key -> (state, detail)


class Registry:
    """Holds the fixes, their per-target state, and the originals needed for an exact revert."""

    def __init__(self, fixes: tuple[Fix, ...], support: tuple[Target, ...] = ()) -> None:
        self.fixes = {fix.name: fix for fix in fixes}
        # Support targets (the metrics flush) serve every fix: wrapped while any fix is enabled, never reported.
        self.support = support
        self._records = {fix.name: _FixRecord() for fix in fixes}
        self._patched: dict[str, _Patched] = {}
        self._hooked_modules: set[str] = set()
        self._active = False
        self._reverted = False
        self._strict = False
        self._lock = threading.RLock()
        self._warned: set[tuple[str, str]] = set()  # (fix, reason) already warned by _skip
        _registries.append(self)

    # ------------------------------------------------------------------ public
    def apply(self) -> None:
        """Enable every switched-on fix; idempotent. Bad switch values raise SwitchValueError at once."""
        with self._lock:
            validate_environment(list(self.fixes))
            if self._active:
                return
            self._strict = strict_mode()
            self._active = True
            self._reverted = False
            for fix in self.fixes.values():
                record = self._records[fix.name]
                record.enabled = fix_enabled(fix.name)
                record.targets = {
                    target.key: ("pending", f"waits for `import {target.module}`") for target in fix.targets
                }
                if record.enabled:
                    self._warn_version_drift(fix)
            modules = {t.module for f in self.fixes.values() for t in f.targets} | {t.module for t in self.support}
            for module_name in sorted(modules):
                if module_name in self._hooked_modules:
                    if module_name in sys.modules:
                        self._on_import(sys.modules[module_name])
                else:
                    self._hooked_modules.add(module_name)
                    wrapt.register_post_import_hook(self._on_import, module_name)
            LOGGER.info("trl_vlm_fixes: %s", self.summary())

    def revert(self) -> None:
        """Put back the exact original attributes; nothing of ours stays on any class."""
        with self._lock:
            for key, patched in reversed(list(self._patched.items())):  # last wrapped is outermost
                current = vars(patched.owner).get(patched.attribute)
                if current is patched.wrapper:
                    setattr(patched.owner, patched.attribute, patched.original)
                else:
                    LOGGER.warning(
                        "trl_vlm_fixes: %s.%s was replaced by someone else after we wrapped it; leaving it alone.",
                        patched.owner.__name__,
                        patched.attribute,
                    )
                del self._patched[key]
            self._active = False
            self._reverted = True
            LOGGER.info("trl_vlm_fixes: all fixes reverted")

    def import_targets(self) -> None:
        """Import every target module so that the states become final (used by the CLI and the self-test)."""
        for fix in self.fixes.values():
            for target in fix.targets:
                try:
                    importlib.import_module(target.module)
                except ModuleNotFoundError as error:
                    if target.optional and error.name and target.module.startswith(error.name):
                        self._set(fix, target, "absent", f"{target.module} does not exist in this TRL")
                    elif self._active and self._records[fix.name].enabled:
                        self._skip(fix, target, f"cannot import {target.module}: {error}")
                except Exception as error:  # noqa: BLE001 - report, never crash the status command
                    if self._active and self._records[fix.name].enabled:
                        self._skip(fix, target, f"cannot import {target.module}: {error!r}")

    def fix_state(self, name: str) -> tuple[str, str]:
        """(state, detail) of one fix, aggregated over its targets."""
        fix = self.fixes[name]
        record = self._records[name]
        if self._reverted and not self._active:
            return "disabled", "reverted by trl_vlm_fixes.revert(); trl_vlm_fixes.apply() puts it back"
        if not record.enabled:
            return "disabled", f"turned off by the environment ({fix.switch} or TRL_VLM_FIXES)"
        states = {key: value for key, value in record.targets.items() if value[0] != "absent"}
        by_state: dict[str, list[str]] = {}
        for state, detail in states.values():
            by_state.setdefault(state, []).append(detail)
        if "skipped" in by_state:
            return "skipped", "; ".join(by_state["skipped"])
        if "applied" in by_state:  # where a target steps aside (trl vllm-serve on TRL >= 1.11), the detail says so
            details = by_state["applied"] + by_state.get("not-needed", []) + by_state.get("pending", [])
            return "applied", "; ".join(details)
        if "not-needed" in by_state:
            return "not-needed", "; ".join(by_state["not-needed"])
        return "pending", "; ".join(by_state.get("pending", [])) or "no target present"

    def summary(self) -> str:
        return ", ".join(f"{name}={self.fix_state(name)[0]}" for name in self.fixes)

    # ----------------------------------------------------------------- internals
    def _warn_version_drift(self, fix: Fix) -> None:
        drift = version_drift(fix.packages)
        if drift:
            found = ", ".join(f"{pkg} {installed} (validated: {validated})" for pkg, installed, validated in drift)
            LOGGER.warning(
                "trl_vlm_fixes: fix %s was validated on other versions than installed: %s. It still applies if its "
                "target has the expected shape; set %s=0 to turn it off.",
                fix.name,
                found,
                fix.switch,
            )

    def _on_import(self, module: ModuleType) -> None:
        """Post-import hook: must never break the import (unless strict mode asks for it)."""
        try:
            with self._lock:
                if not self._active:
                    return
                for fix in self.fixes.values():
                    if not self._records[fix.name].enabled:
                        continue
                    for target in fix.targets:
                        if target.module == module.__name__ and _patch_key(fix.name, target) not in self._patched:
                            self._patch_guarded(fix, target, module)
                if any(record.enabled for record in self._records.values()):
                    for target in self.support:
                        if target.module == module.__name__ and _patch_key("", target) not in self._patched:
                            self._patch(None, target, module)
        except FixNotApplicableError:
            raise
        except Exception as error:  # noqa: BLE001 - a hook must not break the user's import
            LOGGER.warning("trl_vlm_fixes: internal error while patching %s: %r", module.__name__, error)

    def _patch_guarded(self, fix: Fix, target: Target, module: ModuleType) -> None:
        """One target's failure leaves it ``skipped`` and never stops the other fixes' targets in the module."""
        try:
            self._patch(fix, target, module)
        except FixNotApplicableError:
            raise
        except Exception as error:  # noqa: BLE001 - a hook must not break the user's import
            self._skip(fix, target, f"internal error while wrapping {target.qualname}: {error!r}")

    def _patch(self, fix: Fix | None, target: Target, module: ModuleType) -> None:
        """Wrap one target in place; ``fix`` None is a support target (metrics flush), never reported."""
        class_name, _, attribute = target.qualname.rpartition(".")
        owner = getattr(module, class_name, None)
        original = vars(owner).get(attribute) if isinstance(owner, type) else None
        problem = _target_problem(owner, class_name, original, target)
        if fix is None:
            if problem:
                LOGGER.debug("trl_vlm_fixes: support target %s absent (%s); no fix metrics", target.key, problem)
                return
        elif problem:
            self._skip(fix, target, problem)
            return
        elif reason := target.upstream_fixed(original):  # type: ignore[arg-type]  # checked: a callable
            self._set(fix, target, "not-needed", f"{target.qualname}: {reason}")
            LOGGER.info("trl_vlm_fixes: %s steps aside for %s: %s", fix.name, target.qualname, reason)
            return
        assert isinstance(owner, type) and original is not None  # _target_problem checked both
        wrapper = wrapt.FunctionWrapper(original, target.wrapper)
        setattr(owner, attribute, wrapper)
        self._patched[_patch_key(fix.name if fix else "", target)] = _Patched(owner, attribute, original, wrapper)
        if fix is not None:
            self._set(fix, target, "applied", f"{target.qualname} wrapped")
            LOGGER.debug("trl_vlm_fixes: %s wrapped %s", fix.name, target.key)

    def set_state(self, fix_name: str, target_key: str, state: str, detail: str) -> None:
        with self._lock:
            record = self._records.get(fix_name)
            if record is not None and target_key in record.targets and self._active:
                record.targets[target_key] = (state, detail)

    def _set(self, fix: Fix, target: Target, state: str, detail: str) -> None:
        self._records[fix.name].targets[target.key] = (state, detail)

    def _skip(self, fix: Fix, target: Target, reason: str) -> None:
        """State ``skipped``; one WARNING per fix and reason (an engine fix meets one vLLM reason at every target)."""
        self._set(fix, target, "skipped", reason)
        message = (
            f"trl_vlm_fixes: fix {fix.name} cannot be applied ({reason}); the run continues without it. "
            f"Set {fix.switch}=0 to acknowledge, or pin the validated versions (trl==1.9.1, vllm==0.25.1)."
        )
        if self._strict:
            raise FixNotApplicableError(message + " (raised because TRL_VLM_FIXES_STRICT=1)")
        cause = reason.removeprefix(f"{target.qualname}: ")
        if (fix.name, cause) not in self._warned:
            self._warned.add((fix.name, cause))
            LOGGER.warning(message)


def _target_problem(owner: Any, class_name: str, original: Any, target: Target) -> str | None:
    """Why ``target`` cannot be wrapped as declared (class or method gone, or not the shape it relies on)."""
    if not isinstance(owner, type):
        return f"{target.module}.{class_name} not found"
    if original is None:
        return f"{target.qualname} is no longer defined on {class_name}"
    if not callable(original):
        return f"{target.qualname} is not a function"
    problem = _missing_parameters(original, target.required_parameters) or target.shape_problem(original)
    return problem and f"{target.qualname}: {problem}"


def _patch_key(fix_name: str, target: Target) -> str:
    """Several fixes may wrap one method (the engine builder): each wrapper is recorded on its own."""
    return f"{fix_name}|{target.key}"


def _missing_parameters(function: Callable[..., Any], required: tuple[str, ...]) -> str | None:
    if not required:
        return None
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return "signature cannot be inspected"
    missing = [name for name in required if name not in parameters]
    return f"signature lacks {', '.join(missing)}" if missing else None
