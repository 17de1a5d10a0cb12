"""How the engine fixes (``cudagraph``, ``gdn_prefill``, ``expert_layout``) add arguments to the vLLM engine TRL
builds.

One mechanism, owned by the core: each engine fix declares its contribution (``Fix.engine = EngineContribution(...)``)
and never wraps anything for it; the core wraps each engine builder (``seams.ENGINE_BUILDERS``) once, whatever the
number of engine fixes, and that one wrapper applies the contribution of every engine fix applied there, in the order
``seams.ENGINE_CONTRIBUTIONS`` declares, to the keyword arguments of the ``LLM(...)`` call that TRL's own code makes,
at the moment it makes it. Nothing passes between fixes: the wrapper asks the registry which fixes are applied on its
builder (``Registry.engine_fixes``) at each build, so ``revert("cudagraph")`` stops that contribution alone. How it
reaches the call depends on how TRL's code names ``LLM``:

* colocated (``VLLMGeneration._init_vllm``, ``OnlineDPOTrainer.__init__``): ``LLM`` is a module global, so the
  builder runs with a private copy of its globals in which ``LLM`` applies the contributions. Nothing is rebound: two
  engines built at once never see each other's, an engine bound to the module's ``LLM`` (a stand-in) is reached as
  well, and ``revert()`` leaves nothing behind;
* server (``trl vllm-serve``): ``llm_worker`` imports ``LLM`` inside itself, and under ``python -m`` it lives in
  ``__main__`` (``__mp_main__`` in spawned data-parallel workers) where no import hook reaches it. So the wrapper
  sits on ``vllm.LLM.__init__`` and acts when TRL's ``vllm_serve.py`` file is on the calling stack: the file, not
  the module's name, is the same however the server was started.

An engine built where a contribution was expected but never applied sets the fix's state to ``skipped``.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import logging
import os
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import protection
from .declaration import Fix, Target, WrapperFunction
from .logs import fix_logger
from .registry import active, report_runtime_state
from .seams import ENGINE_BUILDERS, EngineBuilder
from .source_shape import calls_name, function_tree

LOGGER = fix_logger(__name__)


@dataclass
class EngineBuild:
    """One ``LLM(...)`` call as the contributions see it: the caller, the served model's config and what changed."""

    caller: str
    model_config: Any
    protection: protection.Verdict = protection.NOT_ARMED  # the protection state read for this engine (and why)
    changes: list[str] = field(default_factory=list)  # "name=value (why)", for the one log line per engine
    stepped_aside: list[tuple[str, str]] = field(default_factory=list)  # (fix, why it leaves this engine alone)
    protected_by: list[str] = field(default_factory=list)  # the fixes whose setting the protection raised
    why: dict[str, str] = field(default_factory=dict)  # fix -> why its setting (status and the trainer-start line)
    settings: dict[str, Any] = field(default_factory=dict)  # "fix key" -> the value chosen (compared across TP ranks)

    def setting(self, fix_name: str, key: str, selected: Any) -> Any:
        """The fix's setting for this engine: ``selected``, or what it declares for the protection due."""
        chosen = protection.setting(fix_name, key, selected, self.protection.level)
        self.settings[f"{fix_name} {key}"] = chosen
        if chosen != selected:
            self.protected_by.append(fix_name)
            self.why.setdefault(fix_name, f"protected: {self.protection.reason}")
        return chosen


# A contribution edits the engine keyword arguments in place and records what it did on the build.
Contribution = Callable[[dict[str, Any], EngineBuild], None]
# What the built engine really runs, read from its own config: (its setting as "name=value", warnings), or None where
# the engine exposes no config to read (then nothing is claimed).
ReadBack = Callable[[Any], "tuple[str, list[str]] | None"]
# Which engines a contribution is proven for (models with Gated-DeltaNet layers, with routed experts); elsewhere it
# steps aside, and the engine's log line gives the contribution's ``aside`` as the reason.
Scope = Callable[[EngineBuild], bool]
NO_GATED_DELTANET = "has no Gated-DeltaNet layers"


def _nothing_read(engine: Any) -> tuple[str, list[str]] | None:
    return None


def _no_reason() -> str | None:
    return None


@dataclass(frozen=True)
class EngineContribution:
    """An engine fix's part in every engine TRL builds (``Fix.engine``): ``contribute`` runs for the engines
    ``acts_on`` accepts; for the others the fix steps aside and the engine's log line says so (``aside``: what such a
    model lacks). ``arguments_problem`` says why the installed vLLM would refuse the arguments (asked of vLLM's own
    classes when TRL's module is patched: the fix is then ``skipped``, the engine built as upstream);
    ``upstream_fixed`` why the installed versions no longer have the bug (``not-needed``); ``read_back`` what the
    built engine runs."""

    contribute: Contribution
    acts_on: Scope
    arguments_problem: Callable[[], str | None]
    upstream_fixed: Callable[[], str | None] = _no_reason
    read_back: ReadBack = _nothing_read
    aside: str = NO_GATED_DELTANET  # what the served model lacks where acts_on declines it

    def targets(self) -> tuple[Target, ...]:
        """The core's targets this fix is reported on: every engine builder, with the core's one wrapper of each
        (``core_owned``: installed once, however many engine fixes declare it) and this fix's own checks."""

        def refused_arguments() -> str | None:
            # where the installed versions have no bug, a missing argument is no reason to warn: not-needed wins
            return None if self.upstream_fixed() else self.arguments_problem()

        def builder_problem(function: Callable[..., Any]) -> str | None:
            return _engine_build_problem(function) or refused_arguments()

        def server_problem(function: Callable[..., Any]) -> str | None:
            return refused_arguments()

        def versions_fixed(function: Callable[..., Any]) -> str | None:
            return self.upstream_fixed()

        def server_not_reached(function: Callable[..., Any]) -> str | None:
            return self.upstream_fixed() or server_builds_elsewhere()

        return tuple(
            Target(
                builder.module,
                builder.qualname,
                _BUILDER_WRAPPERS[builder.key],
                shape_problem=server_problem if builder.server else builder_problem,
                upstream_fixed=server_not_reached if builder.server else versions_fixed,
                optional=builder.optional,
                core_owned=True,
            )
            for builder in ENGINE_BUILDERS
        )


@dataclass
class _Call:
    """One call of an engine builder: whether the contributions reached ``LLM(...)``."""

    applied: bool = False


# What the last engine of this process was built with (the rollout watchdog writes it into its hang report)
last_engine_settings = "(no engine built by TRL in this process yet)"
# engine -> {fix: "what vLLM built (why)"}, for the trainer-start line; weak: never keeps an engine alive
_readings: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def engine_readings(engine: Any) -> dict[str, str]:
    """What each engine fix that acted on ``engine`` read back from it, with why (empty where none did)."""
    try:
        return dict(_readings.get(engine, {}))
    except TypeError:  # not weak-referenceable
        return {}


def served_model_config(trainer: Any, kwargs: dict[str, Any]) -> Any:
    """The config of the model the engine will serve: the trainer's model if it has one, else read from disk."""
    config = getattr(getattr(trainer, "model", None), "config", None)
    if config is not None:
        return config
    path = kwargs.get("model")
    if not path:
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - an unreadable config is reported by the fixes, never a crash here
        LOGGER.debug("cannot read the config of %s: %r", path, error)
        return None


def describe(build: EngineBuild) -> str:
    """One line: the settings chosen and their cost, and which fixes stepped aside and why."""
    parts = []
    if build.changes:
        protected = f" (protected: {build.protection.reason})" if build.protected_by else ""
        parts.append("with " + "; ".join(sorted(build.changes)) + protected)
    reasons: dict[str, list[str]] = {}
    for name, reason in build.stepped_aside:
        if build.model_config is None:  # every scope reads the config: none of them could decide
            reason = "the served model's config could not be read (its layers are unknown)"
        elif reason.startswith("has "):
            reason = f"the served model ({type(build.model_config).__name__}) {reason}"
        reasons.setdefault(reason, []).append(name)
    asides = []
    for reason, names in reasons.items():
        verb = "steps" if len(names) == 1 else "step"
        asides.append(f"{' and '.join(sorted(names))} {verb} aside: {reason}")
    if asides:
        parts.append(("exactly as upstream: " if not build.changes else "") + "; ".join(asides))
    if build.protection.level and not build.protected_by:
        parts.append(
            f"{build.protection.reason}: "
            + ("the selected settings protect as much" if build.changes else "no engine fix acts on this model")
        )
    return "; ".join(parts) + "." if parts else "exactly as upstream."


def serves_gated_deltanet(build: EngineBuild) -> bool:
    """Does the served model have Gated-DeltaNet layers (``linear_attention`` in its text config's layer types)?"""
    config = build.model_config
    text_config = getattr(config, "text_config", None) or config
    layer_types = getattr(text_config, "layer_types", None) or ()
    return "linear_attention" in layer_types


def gated_deltanet_scope(trainer: Any) -> str | None:
    """Why an engine fix for Gated-DeltaNet models steps aside for this trainer: no vLLM engine, or a served model
    without GDN layers (the scope of ``cudagraph`` and ``gdn_prefill``)."""
    if not getattr(trainer, "use_vllm", False):
        return "use_vllm is off: no vLLM engine"
    if not serves_gated_deltanet(EngineBuild("", served_model_config(trainer, {}))):
        return f"the served model {NO_GATED_DELTANET}"
    return None


def _construct(
    builder: EngineBuilder,
    contributions: Sequence[tuple[str, EngineContribution]],
    call: _Call,
    trainer: Any,
    engine: Callable[..., Any],
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Apply the contributions, in their declared order, to ``kwargs``, build the engine, then say in one line what
    vLLM built (read back from the engine's own config, with a warning where a setting changes what a mode means): at
    INFO where the build is healthy, at WARNING where it is not."""
    target_key = builder.key
    model_config = served_model_config(trainer, kwargs)
    build = EngineBuild(builder.caller, model_config, protection.due(builder.server))
    acting = []
    for fix_name, contribution in contributions:
        if contribution.acts_on(build):
            contribution.contribute(kwargs, build)
            if any(name == fix_name for name, _ in build.stepped_aside):
                continue  # it looked at the engine and found nothing to do (its own reason is on the build)
            acting.append((fix_name, contribution))
        else:
            build.stepped_aside.append((fix_name, contribution.aside))
    call.applied = True
    if not builder.server:  # one tensor-parallel group, one engine: a difference is an error here, not a wait there
        chosen = ", ".join(f"{name}={value}" for name, value in sorted(build.settings.items()))
        protection.agree_in_group(trainer, chosen or "no protected setting")
    built = engine(*args, **kwargs)
    # healthy (INFO): every fix that acts got its arguments and vLLM built what they ask, or no fix has work here.
    # WARNING where something is wrong: an earlier run here hung (protected or not: this start follows a hang), the
    # served model's config is unreadable (no fix could decide), a reading below warns or fails, or vLLM built
    # another value than a fix asked for
    healthy = not build.protection.level and not (build.model_config is None and build.stepped_aside)
    readings, by_fix = [], {}
    for fix_name, contribution in acting:
        reading, read = _read_back(contribution, built)
        healthy = healthy and read
        if reading is not None:
            setting, warnings = reading
            readings.append(setting)
            why = build.why.get(fix_name)
            by_fix[fix_name] = setting + (f" ({why})" if why else "")
            report_runtime_state(
                fix_name,
                target_key,
                "applied",
                f"{builder.caller}: engine built with {setting} (read back from the built engine)"
                + (f"; {why}" if why else ""),
            )
            for warning in warnings:
                LOGGER.warning("%s", warning)
            healthy = healthy and not warnings
    for mismatch in asked_but_not_built(build.changes, readings):
        LOGGER.warning("%s", mismatch)
        healthy = False
    with contextlib.suppress(TypeError):  # an engine that cannot be weakly referenced: no trainer-start reading
        _readings[built] = by_fix
    global last_engine_settings
    last_engine_settings = describe(build) + (f" vLLM built: {', '.join(readings)}." if readings else "")
    # rank 0 says it (every rank builds one); a server worker or a process without an accelerator always does
    if getattr(getattr(trainer, "accelerator", None), "is_main_process", True):
        level = logging.INFO if healthy else logging.WARNING
        LOGGER.log(level, "%s built the %s %s", builder.caller, builder.engine, last_engine_settings)
    return built


def asked_but_not_built(changes: list[str], readings: list[str]) -> list[str]:
    """Where vLLM built another value than a fix asked for (vLLM rewrites some settings itself, e.g. a CUDA-graph mode
    its other options rule out): one line each. ``changes``: ``name=value (why)``; a value that is not one word
    (``vLLM's own ...``) asks for nothing in particular. ``readings``: ``name=value``, read from the built engine."""
    built = dict(reading.split("=", 1) for reading in readings if "=" in reading)
    lines = []
    for change in changes:
        name, _, rest = change.partition("=")
        asked = rest.split(" (", 1)[0]
        if name in built and " " not in asked and _value_name(built[name]) != _value_name(asked):
            lines.append(
                f"vLLM built {name}={built[name]} where {name}={asked} was asked: the fix's setting is not in effect"
            )
    return lines


def _value_name(value: str) -> str:
    """A setting's value as compared: an enum's member name (``MoEBackend.TRITON``), case aside."""
    return value.rsplit(".", 1)[-1].lower()


def _read_back(contribution: EngineContribution, engine: Any) -> tuple[tuple[str, list[str]] | None, bool]:
    """What the fix reads back from the built engine, and whether the reading could be taken."""
    try:
        return contribution.read_back(engine), True
    except Exception as error:  # noqa: BLE001 - a report must never break an engine that was built
        return (f"(could not be read: {error!r})", []), False


def _intercept(
    builder: EngineBuilder,
    contributions: Sequence[tuple[str, EngineContribution]],
    call: _Call,
    wrapped: Any,
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run TRL's builder (colocated) or vLLM's constructor (server) so that its ``LLM(...)`` gets the contributions."""
    if builder.server:
        return _construct(builder, contributions, call, None, wrapped, *args, **kwargs)
    function = wrapped.__func__
    namespace = dict(function.__globals__)
    engine = namespace.get("LLM")
    if engine is None:  # vLLM absent: TRL raises its own ImportError
        return wrapped(*args, **kwargs)
    namespace["LLM"] = functools.partial(_construct, builder, contributions, call, instance, engine)
    private = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    private.__kwdefaults__ = function.__kwdefaults__
    return private(wrapped.__self__, *args, **kwargs)


def _is_own_function(wrapped: Any) -> bool:
    """TRL's (or vLLM's) own function, not someone else's wrapper. type(), not isinstance(): wrapt's proxies pretend."""
    return type(wrapped) is types.MethodType and type(wrapped.__func__) is types.FunctionType


@functools.cache
def _server_file() -> str | None:
    """Where TRL's ``vllm_serve.py`` is, found without importing TRL."""
    spec = importlib.util.find_spec("trl")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return os.path.join(locations[0], "scripts", "vllm_serve.py") if locations else None


def server_is_calling() -> bool:
    """Is TRL's server code on the stack? Its module is ``trl.scripts.vllm_serve`` under ``trl vllm-serve``,
    ``__main__`` under ``python -m`` and ``__mp_main__`` in spawned workers; its file is the same in all three."""
    server_file = _server_file()
    if server_file is None:
        return False
    real_server_file = os.path.realpath(server_file)
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == server_file or (
            filename.endswith("vllm_serve.py") and os.path.realpath(filename) == real_server_file
        ):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _contributions(fixes: Sequence[Fix]) -> list[tuple[str, EngineContribution]]:
    contributions = []
    for fix in fixes:
        assert isinstance(fix.engine, EngineContribution)  # Registry.engine_fixes: the fixes that declare one
        contributions.append((fix.name, fix.engine))
    return contributions


def _builder_wrapper(builder: EngineBuilder) -> WrapperFunction:
    """The core's one wrapper on one place where an engine is built: every engine fix applied there contributes."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if builder.server and not server_is_calling():  # another engine than TRL's server: not ours to change
            return wrapped(*args, **kwargs)
        contributions = _contributions(active().engine_fixes(builder.key))
        if not contributions:
            return wrapped(*args, **kwargs)
        call = _Call()
        if _is_own_function(wrapped):
            result = _intercept(builder, contributions, call, wrapped, instance, args, kwargs)
        else:  # someone else's wrapper sits below the core's: the contributions cannot reach its LLM(...)
            result = wrapped(*args, **kwargs)
        engine_built = builder.server or getattr(instance, "llm", None) is not None
        if engine_built and not call.applied:
            build = EngineBuild(builder.caller, served_model_config(None if builder.server else instance, kwargs))
            for fix_name, missed in contributions:  # those that would have acted on this model (all, if unreadable)
                if build.model_config is None or missed.acts_on(build):
                    _report_missed(fix_name, builder.key, builder.caller)
        return result

    return wrapper


def _report_missed(fix_name: str, target_key: str, caller: str) -> None:
    detail = (
        f"{caller} built an engine without going through LLM(...) where the fix waits for it: nothing was injected. "
        "Upgrade trl_vlm_fixes or pin trl==1.9.1."
    )
    LOGGER.warning("%s: %s", fix_name, detail)
    report_runtime_state(fix_name, target_key, "skipped", detail)


@functools.cache
def server_builds_elsewhere() -> str | None:
    """TRL >= 1.11's ``vllm_serve.py`` never calls ``LLM(...)``: it execs vLLM's own server (huggingface/trl#6765),
    whose engine no wrapper here can reach. Read from the file's AST, without importing TRL."""
    server_file = _server_file()
    if server_file is None or not os.path.isfile(server_file):
        return None
    try:
        with open(server_file, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return None
    if calls_name(tree, "LLM"):
        return None
    return (
        "not for `trl vllm-serve`: this TRL execs vLLM's own server, which the engine fixes cannot reach; pass vLLM's "
        "flags to it instead (docs/launcher.md: Server mode on TRL >= 1.11)"
    )


def _engine_build_problem(function: Callable[..., Any]) -> str | None:
    tree = function_tree(function)
    if tree is None:
        return "source unavailable, cannot confirm that it builds vllm.LLM"
    return None if calls_name(tree, "LLM") else "no longer builds the engine with LLM(...)"


# the core's one wrapper per engine builder (``EngineContribution.targets`` declares it for every engine fix)
_BUILDER_WRAPPERS: dict[str, WrapperFunction] = {builder.key: _builder_wrapper(builder) for builder in ENGINE_BUILDERS}
