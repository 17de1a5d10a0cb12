"""Apply and revert fixes in place with wrapt, attaching each one when its target module is imported.

Modelled on ddtrace's ``_monkey`` and OpenTelemetry's instrumentors: post-import hooks make import order irrelevant,
each wrapper sits on the class that defines the method (so subclasses inherit it), and revert puts back the exact
original objects. A hook never breaks the user's import unless strict mode asked for that. Every switch and setting a
fix declares is read once, at ``apply()`` (explicit choices given to ``apply`` win over the environment). Where several
fixes wrap one method, they are wrapped in the order ``seams.py`` declares for it (the order of the fixes given is the
report order only); the core owns each seam once: one wrapper per shared method (``SeamWrapper``: the applied fixes'
declared wrapper functions, called as a chain in that order) and one per engine builder (``engine_args``), whatever
the number of fixes acting there.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import wrapt

from . import seams
from .declaration import TRAINERS, Fix, Target, TargetCheck, WrapperFunction, on_trainers
from .logs import fix_logger
from .switches import master_switch, own_switch, strict_mode, validate_environment
from .versions import version_drift

__all__ = [
    "TRAINERS",
    "Fix",
    "FixNotApplicableError",
    "Hook",
    "Registry",
    "SeamWrapper",
    "Target",
    "TargetCheck",
    "WrapperFunction",
    "on_trainers",
]
LOGGER = fix_logger(__name__)
# the states whose wrappers are in place: stepped-aside is the last trainer's report, the wrappers act all the same
WRAPPED_STATES = ("applied", "stepped-aside")

Choice = bool | Mapping[str, Any]


class FixNotApplicableError(RuntimeError):
    """Raised instead of a warning when TRL_VLM_FIXES_STRICT=1 and an enabled fix cannot be applied."""


_registries: list[Registry] = []


def active() -> Registry:
    """The process's registry (``trl_vlm_fixes.REGISTRY``): the package's one way to reach it (no module of the
    package imports the name from ``trl_vlm_fixes``, whose ``__init__`` builds it)."""
    return _registries[-1]


def value(fix_name: str, key: str) -> Any:
    """A fix's setting as read at the last ``apply()``."""
    return active().value(fix_name, key)


def report_runtime_state(fix_name: str, target_key: str, state: str, detail: str) -> None:
    """A wrapper found at run time that its fix did not act (e.g. nothing reached ``LLM(...)``): status says so."""
    for registry in _registries:
        registry.set_state(fix_name, target_key, state, detail)


class Hook(NamedTuple):
    """One fix's contribution to a shared method: its declared wrapper function (``Target.wrapper``)."""

    fix: str
    wrapper: WrapperFunction


class SeamWrapper:
    """The core's one wrapper on a shared method (a key of ``seams.WRAP_ORDER``), installed as
    ``wrapt.FunctionWrapper(TRL's original, seam)`` while any fix is applied there.

    It calls the applied fixes' hooks as a chain in the declared order: the outermost hook's ``wrapped`` calls the next
    hook, ..., the innermost one's is what wrapt gives this wrapper (TRL's method bound to the instance), exactly as
    when each fix wrapped the method itself. ``hooks`` is read once per call, so a hook added or removed never
    changes a call already running."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.hooks: tuple[Hook, ...] = ()  # innermost (nearest TRL's code) first

    @property
    def fixes(self) -> tuple[str, ...]:
        """The fixes whose hooks the chain calls, outermost (called first) first."""
        return tuple(hook.fix for hook in reversed(self.hooks))

    def add(self, fix: str, wrapper: WrapperFunction) -> None:
        """Put ``fix``'s hook at the place ``seams.WRAP_ORDER`` declares for it, whatever the order hooks come in."""
        hooks = [hook for hook in self.hooks if hook.fix != fix] + [Hook(fix, wrapper)]
        self.hooks = tuple(sorted(hooks, key=lambda hook: seams.position(self.key, hook.fix)))

    def __call__(
        self, wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        hooks = self.hooks
        if not hooks:  # never installed empty: the registry removes the wrapper with its last hook
            return wrapped(*args, **kwargs)
        below: Callable[..., Any] = wrapped
        for hook in hooks[:-1]:  # innermost first: each hook's ``wrapped`` calls the one below it
            below = _Next(wrapped, hook.wrapper, below, instance)
        return hooks[-1].wrapper(below, instance, args, kwargs)


class _Next(wrapt.ObjectProxy):  # type: ignore[misc]
    """A hook's ``wrapped`` where another hook sits below it: calling it calls that hook, with the same instance and
    the arguments given (``args`` a tuple, ``kwargs`` a dict, as wrapt passes them). Everything else is TRL's method
    as bound for this call (proxied): its name, ``__func__``, ``__self__``, ``__module__``, ``__globals__``, its
    signature (``inspect.signature``, ``call_arguments.bind``); ``__wrapped__`` and ``inspect.unwrap`` reach it."""

    def __init__(self, method: Callable[..., Any], hook: WrapperFunction, below: Callable[..., Any], instance: Any):
        super().__init__(method)
        self._self_hook = hook
        self._self_below = below
        self._self_instance = instance

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_hook(self._self_below, self._self_instance, args, kwargs)


@dataclass
class _Patched:
    owner: Any  # the class, or the module of a module-level function
    attribute: str
    original: Any
    wrapper: Any
    shared: bool = False  # the core's wrapper another fix's entry installed (a seam's, an engine builder's)


@dataclass
class _FixRecord:
    enabled: bool = False
    targets: dict[str, tuple[str, str]] = field(default_factory=dict)  # target key -> (state, detail)
    values: dict[str, Any] = field(default_factory=dict)  # setting key -> value read at apply()
    chosen: set[str] = field(default_factory=set)  # setting keys given by the API or the environment
    scope: tuple[str, str] | None = None  # (trainer, why the fix steps aside for it) of the last trainer built
    reverted_alone: bool = False  # revert(name): off until apply() names it again


class Registry:
    """Holds the fixes, their per-target state and settings, and the originals needed for an exact revert."""

    def __init__(self, fixes: tuple[Fix, ...], support: tuple[Target, ...] = ()) -> None:
        seams.check(fixes)  # every fix's place on every seam is declared (SeamOrderError otherwise)
        self.fixes = {fix.name: fix for fix in fixes}
        self._wrapping = _wrapping_order(fixes)
        # Support targets (the metrics flush, the trainer-start line) serve every fix: wrapped while any fix is
        # enabled, never reported.
        self.support = support
        self._records = {fix.name: _FixRecord() for fix in fixes}
        self._patched: dict[str, _Patched] = {}
        self._core_wrapped: dict[str, _Patched] = {}  # target key -> the core's wrapper there (seam, engine builder)
        self._seams: dict[str, SeamWrapper] = {}  # shared method's key -> the hooks its core wrapper calls
        self._hooked_modules: set[str] = set()
        self._active = False
        self._reverted = False
        self._strict = False
        self._choices: dict[str, Choice] = {}  # what apply() was given, kept for the next apply()
        self.scopes_paused = False  # the self-test's own trainers say nothing about the user's
        self._lock = threading.RLock()
        self._warned: set[tuple[str, str]] = set()  # (fix, reason) already warned by _skip
        _registries.append(self)

    # ------------------------------------------------------------------ public
    def apply(self, choices: Mapping[str, Choice] | None = None) -> None:
        """Enable every fix the environment (or ``choices``, which win) allows, reading every setting now; a second
        call with no new choice changes nothing. A bad value raises at once, naming it."""
        with self._lock:
            # a bad value (a choice, a setting or a switch in the environment) raises before anything changes
            validate_environment([name for name, fix in self.fixes.items() if fix.switch_setting is None])
            if choices:
                self._check_choices(choices)
                self._check_values({**self._choices, **choices})
                if self._active:
                    self._unpatch_all()
                    self._active = False
                self._choices.update(choices)
                for name in choices:
                    self._records[name].reverted_alone = False
            if self._active:
                return
            self._read_settings()
            self._strict = strict_mode()
            self._active = True
            self._reverted = False
            for fix in self.fixes.values():
                record = self._records[fix.name]
                record.targets = {
                    target.key: ("pending", f"waits for `import {target.module}`") for target in fix.targets
                }
                if record.enabled:
                    self._warn_version_drift(fix)
            self._hook_modules()
            LOGGER.info("%s", self.summary())

    def revert(self, names: Iterable[str] | None = None) -> None:
        """Put back the exact original attributes of every fix (or of the named ones: the others stay applied)."""
        with self._lock:
            if names is None:
                self._unpatch_all()
                self._active = False
                self._reverted = True
                LOGGER.info("all fixes reverted")
                return
            names = list(names)
            unknown = [name for name in names if name not in self.fixes]
            if unknown:
                raise ValueError(f"no fix named {unknown}; the fixes are {', '.join(self.fixes)}")
            for name in names:
                self._records[name].reverted_alone = True
            if self._active:  # unwrap all, wrap the others again: a seam's core wrapper with the hooks that remain
                self._unpatch_all()
                self._active = False
                self.apply()

    def value(self, fix_name: str, key: str) -> Any:
        record = self._records[fix_name]
        if key not in record.values:  # before any apply(): read now (the module-level accessors may be called early)
            self._read_fix_settings(self.fixes[fix_name])
        return record.values[key]

    def is_enabled(self, fix_name: str) -> bool:
        """Switched on at the last ``apply()`` (by the environment or the API)."""
        record = self._records[fix_name]
        if not record.values and not self._active:  # before any apply(): read now
            self._read_fix_settings(self.fixes[fix_name])
        return record.enabled and not (self._reverted and not self._active)

    def chosen(self, fix_name: str, key: str) -> bool:
        """Was this setting given (API or environment) rather than left at its default?"""
        return key in self._records[fix_name].chosen

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

    def record_scope(self, trainer: Any) -> None:
        """A GRPO/RLOO trainer was built: each applied fix records whether it acts for it (its declared scope)."""
        with self._lock:
            if self.scopes_paused:
                return
            for fix in self.fixes.values():
                try:
                    reason = fix.scope(trainer)
                except Exception as error:  # noqa: BLE001 - a report must never break building a trainer
                    reason = f"its scope could not be read ({error!r})"
                self._records[fix.name].scope = (type(trainer).__name__, reason) if reason else None

    def forget_scopes(self) -> None:
        """No trainer built yet, as far as the reports go (each test starts from none; the wrappers stay)."""
        with self._lock:
            for record in self._records.values():
                record.scope = None

    def fix_state(self, name: str) -> tuple[str, str]:
        """(state, detail) of one fix, aggregated over its targets."""
        fix = self.fixes[name]
        record = self._records[name]
        if record.reverted_alone:
            again = f"trl_vlm_fixes.apply({name}=True) puts it back"
            return "disabled", f"reverted by trl_vlm_fixes.revert({name!r}); {again}"
        if self._reverted and not self._active:
            return "disabled", "reverted by trl_vlm_fixes.revert(); trl_vlm_fixes.apply() puts it back"
        if not record.enabled:
            how = "trl_vlm_fixes.apply()" if name in self._choices else "the environment"
            return "disabled", f"turned off by {how} ({fix.switch} or TRL_VLM_FIXES)"
        states = {key: value for key, value in record.targets.items() if value[0] != "absent"}
        by_state: dict[str, list[str]] = {}
        for state, detail in states.values():
            if detail not in by_state.setdefault(state, []):  # several targets in one module wait for one import
                by_state[state].append(detail)
        if "skipped" in by_state:
            return "skipped", "; ".join(by_state["skipped"])
        if "applied" in by_state:  # where a target steps aside (trl vllm-serve on TRL >= 1.11), the detail says so
            if record.scope is not None:
                trainer, reason = record.scope
                return "stepped-aside", f"wrapped, but it steps aside for {trainer}: {reason}"
            details = by_state["applied"] + by_state.get("not-needed", []) + by_state.get("pending", [])
            return "applied", "; ".join(details)
        if "not-needed" in by_state:
            return "not-needed", "; ".join(by_state["not-needed"])
        return "pending", "; ".join(by_state.get("pending", [])) or "no target present"

    def engine_fixes(self, target_key: str) -> list[Fix]:
        """The engine fixes applied on the engine builder ``target_key`` (its wrapper is the core's one), in the order
        ``seams.ENGINE_CONTRIBUTIONS`` declares: the contributions the core's wrapper applies at this build."""
        with self._lock:
            return [
                self.fixes[name]
                for name in seams.ENGINE_CONTRIBUTIONS
                if name in self.fixes and f"{name}|{target_key}" in self._patched
            ]

    def summary(self) -> str:
        return ", ".join(f"{name}={self.fix_state(name)[0]}" for name in self.fixes)

    def set_state(self, fix_name: str, target_key: str, state: str, detail: str) -> None:
        with self._lock:
            record = self._records.get(fix_name)
            if record is not None and target_key in record.targets and self._active:
                record.targets[target_key] = (state, detail)

    # ----------------------------------------------------------------- settings
    def _check_choices(self, choices: Mapping[str, Choice]) -> None:
        for name, choice in choices.items():
            if name not in self.fixes:
                raise ValueError(
                    f"trl_vlm_fixes.apply({name}=...): no fix of that name; the fixes are {', '.join(self.fixes)}"
                )
            if isinstance(choice, Mapping):
                keys = {setting.key for setting in self._all_settings(self.fixes[name])}
                unknown = sorted(set(choice) - keys)
                if unknown:
                    raise ValueError(
                        f"trl_vlm_fixes.apply({name}={dict(choice)!r}): {name} has no setting {unknown}; its settings "
                        f"are {sorted(keys) or 'none'} (or pass True/False)"
                    )
            elif not isinstance(choice, bool):
                raise ValueError(f"trl_vlm_fixes.apply({name}={choice!r}): pass True, False or a dict of settings")

    def _check_values(self, choices: Mapping[str, Choice]) -> None:
        """Read every setting as ``choices`` and the environment give it, keeping nothing: raises on a bad value."""
        for fix in self.fixes.values():
            choice = choices.get(fix.name)
            given = choice if isinstance(choice, Mapping) else {}
            for setting in self._all_settings(fix):
                setting.read(given.get(setting.key))

    @staticmethod
    def _all_settings(fix: Fix) -> tuple[Any, ...]:
        return (*fix.settings, *((fix.switch_setting,) if fix.switch_setting is not None else ()))

    def _read_settings(self) -> None:
        """Every fix's switch and settings, read now: a bad value raises before anything is wrapped."""
        for fix in self.fixes.values():
            self._read_fix_settings(fix)

    def _read_fix_settings(self, fix: Fix) -> None:
        record = self._records[fix.name]
        choice = self._choices.get(fix.name)
        given = choice if isinstance(choice, Mapping) else {}
        values, chosen = {}, set()
        for setting in self._all_settings(fix):
            values[setting.key], was_chosen = setting.read(given.get(setting.key))
            if was_chosen:
                chosen.add(setting.key)
        record.values, record.chosen = values, chosen
        if isinstance(choice, bool):  # the API wins over every switch, the master switch included
            enabled = choice
        elif isinstance(choice, Mapping):  # settings given: the fix is wanted (unless its own switch value says off)
            switch = fix.switch_setting
            enabled = bool(values[switch.key]) if switch is not None and switch.key in choice else True
        else:
            own = bool(values[fix.switch_setting.key]) if fix.switch_setting is not None else own_switch(fix.name)
            enabled = own and master_switch()
        record.enabled = enabled and not record.reverted_alone

    # ----------------------------------------------------------------- internals
    def _hook_modules(self) -> None:
        modules = {t.module for f in self.fixes.values() for t in f.targets} | {t.module for t in self.support}
        for module_name in sorted(modules):
            if module_name in self._hooked_modules:
                if module_name in sys.modules:
                    self._on_import(sys.modules[module_name])
            else:
                self._hooked_modules.add(module_name)
                wrapt.register_post_import_hook(self._on_import, module_name)

    def _unpatch_all(self) -> None:
        self._core_wrapped.clear()
        self._seams.clear()
        for key, patched in reversed(list(self._patched.items())):  # last wrapped is outermost
            if patched.shared:  # the core's wrapper: put back once, by the entry that installed it
                del self._patched[key]
                continue
            current = vars(patched.owner).get(patched.attribute)
            if current is patched.wrapper:
                setattr(patched.owner, patched.attribute, patched.original)
            else:
                LOGGER.warning(
                    "%s.%s was replaced by someone else after we wrapped it; leaving it alone.",
                    patched.owner.__name__,
                    patched.attribute,
                )
            del self._patched[key]

    def _warn_version_drift(self, fix: Fix) -> None:
        drift = version_drift(fix.packages)
        if drift:
            found = ", ".join(f"{pkg} {installed} (validated: {validated})" for pkg, installed, validated in drift)
            LOGGER.warning(
                "fix %s was validated on other versions than installed: %s. It still applies if its target has the "
                "expected shape; set %s=0 to turn it off.",
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
                for fix, target in self._wrapping:  # on a seam, seams.py's order: innermost first
                    if not self._records[fix.name].enabled:
                        continue
                    if target.module == module.__name__ and _patch_key(fix.name, target) not in self._patched:
                        self._patch_guarded(fix, target, module)
                if any(record.enabled for record in self._records.values()):
                    for target in self.support:
                        if target.module == module.__name__ and _patch_key("", target) not in self._patched:
                            self._patch(None, target, module)
        except FixNotApplicableError:
            raise
        except Exception as error:  # noqa: BLE001 - a hook must not break the user's import
            LOGGER.warning("internal error while patching %s: %r", module.__name__, error)

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
        seam = fix is not None and target.key in seams.WRAP_ORDER  # a shared method: the core's wrapper, fixes' hooks
        installed = self._core_wrapped.get(target.key) if target.core_owned or seam else None
        if installed is not None:  # the core's wrapper is there already: this fix's checks read TRL's own function
            owner, original = installed.owner, installed.original
        else:
            owner = getattr(module, class_name, None) if class_name else module
            original = vars(owner).get(attribute) if isinstance(owner, type | ModuleType) else None
        problem = _target_problem(owner, class_name, original, target)
        if fix is None:
            if problem:
                LOGGER.debug("support target %s absent (%s); no fix metrics", target.key, problem)
                return
        elif problem:
            self._skip(fix, target, problem)
            return
        elif reason := target.upstream_fixed(original):  # type: ignore[arg-type]  # checked: a callable
            self._set(fix, target, "not-needed", f"{target.qualname}: {reason}")
            LOGGER.info("%s steps aside for %s: %s", fix.name, target.qualname, reason)
            return
        assert owner is not None and original is not None  # _target_problem checked both
        key = _patch_key(fix.name if fix else "", target)
        if installed is not None:  # one wrapper of the core's per seam, however many fixes act there
            self._patched[key] = _Patched(owner, attribute, original, installed.wrapper, shared=True)
        else:
            function: WrapperFunction = target.wrapper
            if seam:
                function = self._seams[target.key] = SeamWrapper(target.key)
            wrapper = wrapt.FunctionWrapper(original, function)
            setattr(owner, attribute, wrapper)
            self._patched[key] = _Patched(owner, attribute, original, wrapper)
            if target.core_owned or seam:
                self._core_wrapped[target.key] = self._patched[key]
        if seam:
            assert fix is not None
            self._seams[target.key].add(fix.name, target.wrapper)
        if fix is not None:
            self._set(fix, target, "applied", f"{target.qualname} wrapped")
            LOGGER.debug("%s wrapped %s", fix.name, target.key)

    def _set(self, fix: Fix, target: Target, state: str, detail: str) -> None:
        self._records[fix.name].targets[target.key] = (state, detail)

    def _skip(self, fix: Fix, target: Target, reason: str) -> None:
        """State ``skipped``; one WARNING per fix and reason (an engine fix meets one vLLM reason at every target)."""
        self._set(fix, target, "skipped", reason)
        message = (
            f"fix {fix.name} cannot be applied ({reason}); the run continues without it. "
            f"Set {fix.switch}=0 to acknowledge, or pin the validated versions (trl==1.9.1, vllm==0.25.1)."
        )
        if self._strict:
            raise FixNotApplicableError(f"trl_vlm_fixes: {message} (raised because TRL_VLM_FIXES_STRICT=1)")
        cause = reason.removeprefix(f"{target.qualname}: ")
        if (fix.name, cause) not in self._warned:
            self._warned.add((fix.name, cause))
            LOGGER.warning(message)


def _target_problem(owner: Any, class_name: str, original: Any, target: Target) -> str | None:
    """Why ``target`` cannot be wrapped as declared (class or method gone, or not the shape it relies on)."""
    if class_name and not isinstance(owner, type):
        return f"{target.module}.{class_name} not found"
    if original is None:
        where = class_name or target.module
        return f"{target.qualname} is no longer defined on {where}"
    if not callable(original):
        return f"{target.qualname} is not a function"
    problem = _missing_parameters(original, target.required_parameters) or target.shape_problem(original)
    return problem and f"{target.qualname}: {problem}"


def _patch_key(fix_name: str, target: Target) -> str:
    """Several fixes may act on one method: each fix's target is recorded on its own (a seam's one wrapper, the
    core's, once per fix applied there: ``Registry.engine_fixes`` reads an engine builder's)."""
    return f"{fix_name}|{target.key}"


def _wrapping_order(fixes: tuple[Fix, ...]) -> list[tuple[Fix, Target]]:
    """Every (fix, target), in the order they are patched: on each method, the order ``seams.py`` declares for it
    (innermost first; on an engine builder, ``ENGINE_CONTRIBUTIONS``), whatever the order of ``fixes`` (on a shared
    method, ``SeamWrapper.add`` puts each hook at its declared place whatever this order)."""
    pairs = [(fix, target) for fix in fixes for target in fix.targets]
    slots: dict[str, list[int]] = {}
    for index, (_, target) in enumerate(pairs):
        slots.setdefault(target.key, []).append(index)
    ordered = list(pairs)
    for key, indices in slots.items():
        entries = sorted((pairs[index] for index in indices), key=lambda pair: _rank(key, pair[0].name))
        for index, entry in zip(indices, entries, strict=True):
            ordered[index] = entry
    return ordered


def _rank(key: str, fix_name: str) -> int:
    if key in seams.ENGINE_BUILDER_KEYS:
        return seams.ENGINE_CONTRIBUTIONS.index(fix_name)  # seams.check: every engine fix is named there
    return seams.position(key, fix_name)


def _missing_parameters(function: Callable[..., Any], required: tuple[str, ...]) -> str | None:
    if not required:
        return None
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return "signature cannot be inspected"
    missing = [name for name in required if name not in parameters]
    return f"signature lacks {', '.join(missing)}" if missing else None
