"""The shape of a fix: everything the rest of the plugin needs to know about it, declared in the fix's own module.

The core (registry, switches, metrics, status, the trainer-start line, the self-test, the CLI) and the tests read these
declarations; nothing lists fixes elsewhere. ``patches/__init__.py``'s ``ALL_FIXES`` is the one list, in the order
the fixes are reported; where several fixes act on one callable, ``seams.py`` declares the order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .switches import Setting, fix_switch

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
    # the same question asked before any trainer exists: why the fix steps aside for this planned run (checkpoint
    # config, mode), or None; read by ``trl-vlm-fixes status --model`` and the docs' tables (``applicability``)
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
