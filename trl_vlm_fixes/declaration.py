"""The shape of a fix: everything the rest of the plugin needs to know about it, declared in the fix's own module.

The core (registry, switches, metrics, status, the trainer-start line, the self-test, the CLI) and the tests read these
declarations; nothing lists fixes elsewhere. ``patches/__init__.py``'s ``ALL_FIXES`` is the one list, in the order
the fixes are reported; where several fixes act on one callable, ``seams.py`` declares the order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from packaging.version import Version

from .switches import Setting, fix_switch
from .versions import installed_version, public_version

WrapperFunction = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
TargetCheck = Callable[[Callable[..., Any]], "str | None"]
# The trainers whose VLM rollouts the fixes serve: (module, class)
TRAINERS = (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))


def _no_problem(function: Callable[..., Any]) -> str | None:
    return None


def _everywhere(trainer: Any) -> str | None:
    return None


# TRL's ways to sample: ``use_vllm`` off (``none``), ``vllm_mode="colocate"`` or ``"server"``
MODES = ("none", "colocate", "server")


@dataclass(frozen=True)
class Plan:
    """A run described before it starts (``trl-vlm-fixes status --model``): the checkpoint's ``config.json``, TRL's
    vLLM mode and sleep mode, the rest at ``GRPOConfig``'s defaults. ``here``: questions only a GPU answers (which MoE
    backend vLLM picks) are asked of this machine; off, the verdict is the model's and the mode's alone (the docs'
    tables)."""

    config: Mapping[str, Any] = field(default_factory=dict)
    mode: str = "colocate"
    sleep_mode: bool = False
    here: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: one of {', '.join(MODES)}")


def _applies_everywhere(plan: Plan) -> str | None:
    return None


# The Qwen vision-language families the fixes are proven on, by ``model_type`` (the self-test's tiny checkpoints): the
# names ``Applicability.families`` takes, and the rows of README's model table
QWEN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl")
VLLM_MODES = ("colocate", "server")
# How each exclusion reads (``Applicability.aside`` gives its ``what``): a mode left out, and the sleep mode needed
_ASIDE = {
    "none": "use_vllm is off: {what}",
    "colocate": "colocate mode: {what}",
    "server": "server mode: {what}",
    "sleep_mode": "{mode} mode without colocated sleep mode: {what}",
    "family": "model type {model_type!r} {what}",
}


def aside_reason(exclusion: str, what: str, plan: Plan) -> str:
    """The line a fix steps aside with for ``exclusion`` (a mode, ``sleep_mode`` or ``family``) in ``plan``."""
    return _ASIDE[exclusion].format(what=what, mode=plan.mode, model_type=plan.config.get("model_type"))


@dataclass(frozen=True)
class VersionBound:
    """Where a bug exists by a package's version: ``package`` installed below ``below`` (the first release without
    it). Declared, not asked: the installed stack's answer is the targets' ``upstream_fixed`` (``not-needed``)."""

    package: str
    below: str

    def __str__(self) -> str:
        return f"{self.package} < {self.below}"

    def holds(self) -> bool:
        """The installed ``package`` is below ``below`` (not installed: it does not hold)."""
        installed = installed_version(self.package)
        return installed is not None and Version(public_version(installed)) < Version(self.below)


@dataclass(frozen=True)
class Applicability:
    """Where a fix acts, as data: the families, the modes, sleep mode and the versions where its bug exists, with the
    reason it steps aside for each exclusion. ``Fix.applies`` is derived from it (``reason``); README's model and mode
    tables are checked against it (``tests/test_docs.py``).

    ``aside``: for each exclusion, what the fix then has nothing to act on, read as ``_ASIDE`` says: every mode not in
    ``modes`` (``"none"``: ``use_vllm is off: ...``), ``"sleep_mode"`` where it needs TRL's colocated engine with
    ``vllm_enable_sleep_mode=True``, ``"family"`` where ``families`` decides by ``model_type`` (no ``checkpoint``).
    ``checkpoint``: the rest of the rule where the families are a fact of the checkpoint's config, not a list of names
    (its layers, its vision markers, the MoE backend of this machine): asked once the modes let the fix act; then
    ``families`` are the Qwen families it lets through (a test checks the two agree). ``installed``: a question of
    the TRL imported in this process, asked last, where the fix stays applied but steps aside on it."""

    aside: Mapping[str, str] = field(default_factory=dict, hash=False)
    modes: tuple[str, ...] = MODES
    sleep_mode: bool = False
    families: tuple[str, ...] | None = None  # ``model_type`` values of ``QWEN_FAMILIES``; None: every family
    versions: tuple[VersionBound, ...] = ()  # the bug exists where one of them holds; none: on every version
    checkpoint: Callable[[Plan], str | None] | None = None
    installed: Callable[[], str | None] | None = None

    def __post_init__(self) -> None:
        problems = [f"mode {mode!r}: one of {', '.join(MODES)}" for mode in self.modes if mode not in MODES]
        if self.sleep_mode and self.modes != ("colocate",):
            problems.append("sleep_mode needs modes=('colocate',): TRL's colocated engine sleeps")
        needed = [mode for mode in MODES if mode not in self.modes and not (self.sleep_mode and mode != "none")]
        needed += ["sleep_mode"] if self.sleep_mode else []
        needed += ["family"] if self.families is not None and self.checkpoint is None else []
        problems += [f"no aside[{key!r}]: why it steps aside there" for key in needed if key not in self.aside]
        problems += [f"aside[{key!r}] is never said" for key in self.aside if key not in needed]
        unknown = set(self.families or ()) - set(QWEN_FAMILIES)
        problems += [f"families {sorted(unknown)}: not in QWEN_FAMILIES"] if unknown else []
        if problems:
            raise ValueError("Applicability: " + "; ".join(problems))

    def reason(self, plan: Plan) -> str | None:
        """Why the fix steps aside for ``plan``, or None: the mode, sleep mode, the family (``checkpoint``), then
        ``installed``."""
        if plan.mode == "none" and "none" not in self.modes:
            return aside_reason("none", self.aside["none"], plan)
        if self.sleep_mode and not (plan.mode == "colocate" and plan.sleep_mode):
            return aside_reason("sleep_mode", self.aside["sleep_mode"], plan)
        if plan.mode not in self.modes:
            return aside_reason(plan.mode, self.aside[plan.mode], plan)
        if self.checkpoint is not None:
            if reason := self.checkpoint(plan):
                return reason
        elif self.families is not None and plan.config.get("model_type") not in self.families:
            return aside_reason("family", self.aside["family"], plan)
        return self.installed() if self.installed is not None else None

    def acts(self, mode: str, family: str, sleep_mode: bool = True) -> bool:
        """The declaration alone (no config asked): whether the fix acts for ``family`` (a ``model_type`` of
        ``QWEN_FAMILIES``) in ``mode``, with or without sleep mode (README's tables)."""
        if mode not in self.modes or (self.sleep_mode and not sleep_mode):
            return False
        return self.families is None or family in self.families


def _is_check_reference(reference: object) -> bool:
    """``"package.module:function"``: dotted identifiers, one colon (the shape only: resolved by the self-test)."""
    if not isinstance(reference, str) or reference.count(":") != 1:
        return False
    module, function = reference.split(":")
    return all(part.isidentifier() for part in module.split(".")) and function.isidentifier()


@dataclass(frozen=True)
class Target:
    """One callable to wrap: ``Class.method`` (or a module-level ``function``) inside ``module``."""

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
    # The core's own wrapper (an engine builder's, ``seams.ENGINE_BUILDERS``), declared for the fix by its ``engine``:
    # installed once whatever the number of fixes that declare it; each fix's state is reported on its own.
    core_owned: bool = False

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class Counter:
    """A training metric a fix counts (``metrics.count``): summed over ranks at every log, or, as a ``mean``, its
    sum and item count summed over ranks, then divided."""

    name: str
    kind: Literal["sum", "mean"] = "sum"


@dataclass(frozen=True)
class ServerAdvice:
    """What an engine fix would give the engine of vLLM's own server, which ``trl vllm-serve`` (TRL >= 1.11) execs in
    its place out of the fixes' reach: as that server's flags (``server_flags`` says them in the server)."""

    flags: tuple[str, ...] = ()  # to pass now, less those the server's command already has
    after_hang: str | None = None  # to restart with after the trainer's watchdog reports a server generate that hung
    after_repeated_hang: str = ""  # what a second hang asks for, named beside ``after_hang``


class EngineSeam(Protocol):
    """What ``Fix.engine`` declares (``engine_args.EngineContribution``): the fix's contribution to every engine TRL
    builds, and the core's targets it reports on (every engine builder, each wrapped once by the core)."""

    def targets(self) -> tuple[Target, ...]: ...


@dataclass(frozen=True)
class Fix:
    """One fix, as its module declares it (``FIX = Fix(...)``, the module's last statement)."""

    name: str
    summary: str
    packages: tuple[str, ...]  # whose validated versions the fix was proven on (a drift warns)
    # what the fix wraps itself; an engine fix's engine builders are added from ``engine`` (never declared here)
    targets: tuple[Target, ...] = ()
    # values beyond on/off (validated at apply(), read with registry.value)
    settings: tuple[Setting, ...] = ()
    counters: tuple[Counter, ...] = ()
    # the self-test check, named, never imported: "module:function" (``"trl_vlm_fixes.selftest.checks.<name>:check"``),
    # a (context, model family) -> selftest.runner.CheckResult that the self-test resolves when it runs (a fix never
    # imports the harness; its check, in the harness, imports what it needs of the fix)
    selftest: str | None = None
    # why the fix steps aside for this trainer (its model, mode, settings), or None: the trainer-start line and
    # status say "stepped-aside" with the reason instead of "applied"
    scope: Callable[[Any], str | None] = _everywhere
    # where the fix acts, as data (families, modes, sleep mode, versions, with the reason of each exclusion): what
    # ``applies`` is derived from and README's model and mode tables are checked against
    applicability: Applicability | None = None
    # the same question asked before any trainer exists: why the fix steps aside for this planned run (checkpoint
    # config, mode), or None; read by ``trl-vlm-fixes status --model`` (``applicability``). Derived from
    # ``applicability`` (``Applicability.reason``); declared only by a fix that has no ``applicability`` yet
    applies: Callable[[Plan], str | None] = _applies_everywhere
    # its settings for an engine built after a hang (``protection.Level``: after an engine hang, after one repeated
    # at one step): (level, key, value), each from its level up, unless the selected value protects as much
    protected: tuple[tuple[int, str, Any], ...] = ()
    # a switch that is not on/off (the watchdog's seconds): the fix is on when its value is truthy
    switch_setting: Setting | None = None
    # called with every GRPO/RLOO trainer once its ``__init__`` returned, whatever the fix's state, before the
    # trainer-start line (the watchdog: the trainer owns its engine)
    at_trainer_start: Callable[[Any], None] | None = None
    # an engine fix, asked in vLLM's own server exec'd by ``trl vllm-serve`` (with the server's command line) while it
    # is enabled: the flags that give that engine what the fix would (``server_flags``)
    server_advice: Callable[[Sequence[str]], ServerAdvice] | None = None
    # an engine fix's contribution to the ``LLM(...)`` arguments of every engine TRL builds
    # (``engine_args.EngineContribution``): the core wraps each engine builder once and applies it there
    engine: EngineSeam | None = None

    def __post_init__(self) -> None:
        own = tuple(target for target in self.targets if not target.core_owned)  # dataclasses.replace: derived again
        derived = self.engine.targets() if self.engine is not None else ()
        object.__setattr__(self, "targets", (*own, *derived))
        # ``applies`` from the data, also after ``dataclasses.replace`` (a rule given in its place is kept)
        if self.applicability is not None and (
            self.applies is _applies_everywhere or isinstance(getattr(self.applies, "__self__", None), Applicability)
        ):
            object.__setattr__(self, "applies", self.applicability.reason)
        if self.selftest is not None and not _is_check_reference(self.selftest):
            raise TypeError(
                f"fix {self.name}: selftest={self.selftest!r}: name the check as 'module:function' "
                f"(e.g. 'trl_vlm_fixes.selftest.checks.{self.name}:check'), never the function itself"
            )

    @property
    def switch(self) -> str:
        return fix_switch(self.name)


def on_trainers(wrappers: dict[str, WrapperFunction], **options: Any) -> tuple[Target, ...]:
    """The same wrappers (method name -> wrapper) on every class of ``TRAINERS``, in that order."""
    return tuple(
        Target(module, f"{cls}.{method}", wrapper, **options)
        for module, cls in TRAINERS
        for method, wrapper in wrappers.items()
    )


def is_rl_trainer(instance: Any) -> bool:
    """A GRPOTrainer or RLOOTrainer (or a subclass of one): TRL's classes, by module and name, through the MRO."""
    return any((cls.__module__, cls.__name__) in TRAINERS for cls in type(instance).__mro__)
