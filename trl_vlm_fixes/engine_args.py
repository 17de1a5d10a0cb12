"""One way for fixes to add arguments to the vLLM engine TRL builds: at TRL's own ``LLM(...)`` call.

Several fixes (``cudagraph``, ``gdn_prefill``) wrap the same TRL method that builds the engine. Each wrapper adds its
contribution to a per-call list held in a ``ContextVar``; the wrapper closest to TRL's function runs it once with a
private copy of its module namespace in which ``LLM`` is a factory that applies every contribution. Nothing global is
rebound, so two engines built at once (threads, tasks) never see each other's factory, and ``revert()`` leaves nothing
behind. After the call, a fix whose contribution never reached ``LLM(...)`` while an engine was built says so: its
status is not left at ``applied``.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from .registry import Target, report_runtime_state
from .source_shape import calls_name, function_tree

LOGGER = logging.getLogger("trl_vlm_fixes")


@dataclass
class EngineBuild:
    """One ``LLM(...)`` call as the contributions see it: the caller, the served model's config and what changed."""

    caller: str
    model_config: Any
    changes: list[str] = field(default_factory=list)  # "name=value (why)", for the one log line per engine
    stepped_aside: list[str] = field(default_factory=list)  # fixes that leave this engine alone (no GDN layers)
    reached: set[str] = field(default_factory=set)  # fixes whose contribution ran


# A contribution edits the engine keyword arguments in place and records what it did on the build.
Contribution = Callable[[dict[str, Any], EngineBuild], None]
# Which engines a contribution is proven for (today: models with Gated-DeltaNet layers); elsewhere it steps aside.
Scope = Callable[[EngineBuild], bool]


@dataclass(frozen=True)
class _Contribution:
    fix_name: str
    contribute: Contribution
    acts_on: Scope


_pending: ContextVar[list[_Contribution] | None] = ContextVar("trl_vlm_fixes_engine_args", default=None)
def served_model_config(instance: Any, kwargs: dict[str, Any]) -> Any:
    """The config of the model the engine will serve: the trainer's model if it has one, else read from disk."""
    model = getattr(instance, "model", None)
    config = getattr(model, "config", None)
    if config is not None:
        return config
    path = kwargs.get("model")
    if not path:
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - an unreadable config is reported by the fixes, never a crash here
        LOGGER.debug("trl_vlm_fixes: cannot read the config of %s: %r", path, error)
        return None


class _EngineFactory:
    """Stands in for ``LLM`` inside one call of TRL's engine builder: applies the contributions, builds the engine."""

    def __init__(self, engine_class: Any, instance: Any, caller: str, contributions: list[_Contribution]):
        self.engine_class = engine_class
        self.instance = instance
        self.caller = caller
        self.contributions = contributions
        self.builds: list[EngineBuild] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        build = EngineBuild(self.caller, served_model_config(self.instance, kwargs))
        for contribution in self.contributions:
            if contribution.acts_on(build):
                contribution.contribute(kwargs, build)
            else:
                build.stepped_aside.append(contribution.fix_name)
            build.reached.add(contribution.fix_name)
        self.builds.append(build)
        global last_engine_settings
        last_engine_settings = describe(build)
        if _is_main_process(self.instance):
            LOGGER.warning("trl_vlm_fixes: %s builds the colocated vLLM engine %s", self.caller, last_engine_settings)
        return self.engine_class(*args, **kwargs)


# What the last engine of this process was built with (the rollout watchdog writes it into its hang report)
last_engine_settings = "(no engine built by TRL in this process yet)"


def describe(build: EngineBuild) -> str:
    """One line: the settings chosen and their cost, and which fixes stepped aside and why."""
    parts = []
    if build.changes:
        parts.append("with " + "; ".join(sorted(build.changes)))
    if build.stepped_aside:
        model = type(build.model_config).__name__ if build.model_config is not None else "an unreadable config"
        verb = "steps" if len(build.stepped_aside) == 1 else "step"
        names = " and ".join(sorted(build.stepped_aside))
        aside = f"{names} {verb} aside: the served model ({model}) has no Gated-DeltaNet layers"
        parts.append(("exactly as upstream: " if not build.changes else "") + aside)
    return "; ".join(parts) + "." if parts else "exactly as upstream."


def serves_gated_deltanet(build: EngineBuild) -> bool:
    """Does the served model have Gated-DeltaNet layers (``linear_attention`` in its text config's layer types)?"""
    config = build.model_config
    text_config = getattr(config, "text_config", None) or config
    layer_types = getattr(text_config, "layer_types", None) or ()
    return "linear_attention" in layer_types


def _is_main_process(instance: Any) -> bool:
    """Rank 0 logs what the engine gets (every rank builds one); without an accelerator, every process does."""
    accelerator = getattr(instance, "accelerator", None)
    return bool(getattr(accelerator, "is_main_process", True))


def _is_plain_method(wrapped: Any) -> bool:
    # type() and not isinstance(): wrapt's proxies pretend to be the class of what they wrap
    return type(wrapped) is types.MethodType and type(wrapped.__func__) is types.FunctionType


def _call_with_factory(wrapped: Any, args: tuple[Any, ...], kwargs: dict[str, Any], factory_for: Callable) -> Any:
    function = wrapped.__func__
    namespace = dict(function.__globals__)
    engine_class = namespace.get("LLM")
    if engine_class is None:  # vLLM absent: TRL raises its own ImportError
        return wrapped(*args, **kwargs)
    factory = factory_for(engine_class)
    namespace["LLM"] = factory
    private = types.FunctionType(
        function.__code__, namespace, function.__name__, function.__defaults__, function.__closure__
    )
    private.__kwdefaults__ = function.__kwdefaults__
    return private(wrapped.__self__, *args, **kwargs)


SERVER_MODULE = "trl.scripts.vllm_serve"
SERVER_FUNCTION = "llm_worker"


def _called_by_trl_vllm_serve() -> bool:
    """Is the engine being built by ``trl vllm-serve``'s worker (server mode)? Read from the calling frames."""
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code.co_name == SERVER_FUNCTION and frame.f_globals.get("__name__") == SERVER_MODULE:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def engine_builder_wrapper(target_key: str, caller: str, contribution: _Contribution, server: bool = False) -> Callable:
    """The wrapt wrapper one fix puts on a TRL method that calls ``LLM(...)``, or (``server``) on ``LLM.__init__``,
    acting there only when ``trl vllm-serve`` builds its engine."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if server and not _called_by_trl_vllm_serve():
            return wrapped(*args, **kwargs)
        contributions = _pending.get()
        token = None
        if contributions is None:
            contributions = []
            token = _pending.set(contributions)
        contributions.append(contribution)
        factories: list[_EngineFactory] = []
        innermost = _is_plain_method(wrapped)  # TRL's own function, not another fix's wrapper
        try:
            if server and innermost:  # LLM.__init__ itself: edit the arguments, then build
                return _EngineFactory(wrapped, None, caller, contributions)(*args, **kwargs)
            if innermost:

                def factory_for(engine_class: Any) -> _EngineFactory:
                    factory = _EngineFactory(engine_class, instance, caller, contributions)
                    factories.append(factory)
                    return factory

                result = _call_with_factory(wrapped, args, kwargs, factory_for)
            else:  # another fix's wrapper sits below ours: it runs the builder with every contribution
                result = wrapped(*args, **kwargs)
        finally:
            if token is not None:
                _pending.reset(token)
        if innermost and getattr(instance, "llm", None) is not None:
            reached = {name for factory in factories for build in factory.builds for name in build.reached}
            for missed in contributions:
                if missed.fix_name not in reached:
                    _report_missed(missed.fix_name, target_key, caller)
        return result

    return wrapper


def _report_missed(fix_name: str, target_key: str, caller: str) -> None:
    detail = (
        f"{caller} built an engine without going through LLM(...) in the wrapped method: nothing was injected. "
        "Upgrade trl_vlm_fixes or pin trl==1.9.1."
    )
    LOGGER.warning("trl_vlm_fixes.%s: %s", fix_name, detail)
    report_runtime_state(fix_name, target_key, "skipped", detail)


def _builds_engine(function: Callable[..., Any]) -> str | None:
    tree = function_tree(function)
    if tree is None:
        return "source unavailable, cannot confirm that it builds vllm.LLM"
    return None if calls_name(tree, "LLM") else "no longer builds the engine with LLM(...)"


# TRL's methods that build a colocated engine with ``LLM(...)``: (module, Class.method, caller, optional)
ENGINE_BUILDERS = (
    ("trl.generation.vllm_generation", "VLLMGeneration._init_vllm", "VLLMGeneration", False),
    ("trl.experimental.online_dpo.online_dpo_trainer", "OnlineDPOTrainer.__init__", "OnlineDPOTrainer", True),
)
# server mode: `trl vllm-serve` imports LLM inside its worker function, so the engine's own constructor is wrapped and
# acts only when that worker calls it (a process the launcher started: trl-vlm-fixes run -- trl vllm-serve ...)
SERVER_ENGINE = ("vllm.entrypoints.llm", "LLM.__init__")


def engine_builder_targets(fix_name: str, contribute: Contribution, acts_on: Scope) -> tuple[Target, ...]:
    """The targets of a fix that adds engine arguments: every TRL method that builds a colocated engine, and the
    engine ``trl vllm-serve`` builds. ``contribute`` runs for the engines ``acts_on`` accepts; for the others the fix
    steps aside and the engine's log line says so."""
    contribution = _Contribution(fix_name, contribute, acts_on)
    colocated = tuple(
        Target(
            module=module,
            qualname=qualname,
            wrapper=engine_builder_wrapper(f"{module}:{qualname}", caller, contribution),
            shape_problem=_builds_engine,
            optional=optional,
        )
        for module, qualname, caller, optional in ENGINE_BUILDERS
    )
    module, qualname = SERVER_ENGINE
    server = Target(
        module=module,
        qualname=qualname,
        wrapper=engine_builder_wrapper(f"{module}:{qualname}", "trl vllm-serve", contribution, server=True),
        optional=True,
    )
    return (*colocated, server)
