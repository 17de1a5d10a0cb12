"""The seams: the callables of TRL's and vLLM's that more than one fix acts on, and the order they act in, declared
once, here. ``ALL_FIXES`` is the report order only: reordering it changes no behaviour.

Two kinds:

* the engine builders (``ENGINE_BUILDERS``): every place TRL builds a vLLM engine with ``LLM(...)``, and the engine
  ``trl vllm-serve`` builds. The core owns each of them: one wrapper per builder (``engine_args``), installed by the
  registry while any engine fix is applied there, which applies every applied engine fix's declared contribution
  (``Fix.engine``) in ``ENGINE_CONTRIBUTIONS`` order. A fix never wraps an engine builder itself;
* the shared methods (``WRAP_ORDER``): a TRL method that several fixes act on. The core owns each of them too: one
  wrapper per method (``registry.SeamWrapper``), installed by the registry while any fix is applied there, which calls
  the applied fixes' declared wrapper functions (``Target.wrapper``, their hooks) as a chain in the order declared
  here, innermost (nearest TRL's code, called last) first: each hook's ``wrapped`` calls the next one down, the
  innermost's TRL's own method. A fix never wraps a shared method itself. The core's own support wrappers (the metrics
  flush, the trainer-start line) are wrapped after every fix: outermost.

``check`` refuses, when a registry is built, a fix that wraps a shared method without being named in its order (or an
engine builder itself, or declares an engine contribution without being named in ``ENGINE_CONTRIBUTIONS``): a new fix
never lands in an arbitrary place. A name declared here whose fix is not registered is passed over.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .declaration import TRAINERS, Fix


class SeamOrderError(ValueError):
    """A fix acts on a seam where this module does not say in which order (raised when a registry is built)."""


@dataclass(frozen=True)
class EngineBuilder:
    """A place where an engine is built: the callable the core wraps, the name its log line gives, which engine."""

    module: str
    qualname: str
    caller: str  # the builder as the engine's log line names it
    engine: str  # "colocated vLLM engine" or "vLLM engine"
    server: bool = False  # vLLM's own constructor: acts only when TRL's vllm_serve.py calls it
    optional: bool = False  # experimental modules may be absent from other TRL releases: their absence is no skip

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"


COLOCATED = "colocated vLLM engine"
# TRL's methods that build a colocated engine with ``LLM(...)``, and (server mode) the engine's own constructor
ENGINE_BUILDERS: tuple[EngineBuilder, ...] = (
    EngineBuilder("trl.generation.vllm_generation", "VLLMGeneration._init_vllm", "VLLMGeneration", COLOCATED),
    EngineBuilder(
        "trl.experimental.online_dpo.online_dpo_trainer",
        "OnlineDPOTrainer.__init__",
        "OnlineDPOTrainer",
        COLOCATED,
        optional=True,
    ),
    EngineBuilder("vllm.entrypoints.llm", "LLM.__init__", "trl vllm-serve", "vLLM engine", server=True, optional=True),
)
ENGINE_BUILDER_KEYS = frozenset(builder.key for builder in ENGINE_BUILDERS)

# The engine fixes' contributions, in the order the core applies them to one ``LLM(...)`` call's arguments (and in
# which the engine's line lists the fixes that step aside and what vLLM built)
ENGINE_CONTRIBUTIONS: tuple[str, ...] = ("expert_layout", "gdn_prefill", "cudagraph")


def _on_trainers(method: str, order: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The same order on ``method`` of every class of ``TRAINERS``."""
    return {f"{module}:{cls}.{method}": order for module, cls in TRAINERS}


_GENERATION = "trl.generation.vllm_generation:VLLMGeneration"
# shared method -> the fixes whose hooks its core wrapper chains, innermost (nearest TRL's code, called last) first
WRAP_ORDER: dict[str, tuple[str, ...]] = {
    f"{_GENERATION}.generate": ("prompt_parity", "sampling_parity", "reload_skip", "wake_reset", "watchdog"),
    # weight_buckets replaces the body of TRL's push loop: innermost, nearest TRL's code
    f"{_GENERATION}.sync_weights": ("weight_buckets", "reload_skip", "wake_reset", "watchdog"),
    # scoring_skip outermost: in a loss pass it reads what sampling_parity made of the policy's log-probs
    **_on_trainers("_get_per_token_logps_and_entropies", ("mm_realign", "sampling_parity", "scoring_skip")),
    # scoring_skip innermost: sampling_parity records the rollout's distribution around it, with the user's settings
    **_on_trainers("_generate_and_score_completions", ("scoring_skip", "sampling_parity", "vision_token_guard")),
    **_on_trainers("_generate", ("reload_skip", "vision_token_guard")),
}


def position(key: str, fix_name: str) -> int:
    """Where ``fix_name``'s hook goes on ``key`` (0: innermost); 0 on a method no other fix wraps."""
    order = WRAP_ORDER.get(key, ())
    return order.index(fix_name) if fix_name in order else 0


def check(fixes: Iterable[Fix]) -> None:
    """Refuse fixes whose place on a seam is not declared here (``SeamOrderError``, naming the seam, the fix and what
    to add)."""
    wrapping: dict[str, list[str]] = {}
    for fix in fixes:
        if fix.engine is not None and fix.name not in ENGINE_CONTRIBUTIONS:
            raise SeamOrderError(
                f"fix {fix.name} declares an engine contribution (engine=...), but trl_vlm_fixes/seams.py's "
                f"ENGINE_CONTRIBUTIONS {ENGINE_CONTRIBUTIONS} does not name it: add {fix.name!r} there, at the place "
                "its contribution must take (they are applied to LLM(...)'s arguments in that order)"
            )
        for target in fix.targets:
            if target.key in ENGINE_BUILDER_KEYS:
                if not target.core_owned:
                    raise SeamOrderError(
                        f"fix {fix.name} wraps {target.key} itself: the core owns every engine builder (one wrapper "
                        "each, trl_vlm_fixes/engine_args.py); declare engine=EngineContribution(...) on the fix "
                        "instead, and add its name to ENGINE_CONTRIBUTIONS in trl_vlm_fixes/seams.py"
                    )
                continue
            names = wrapping.setdefault(target.key, [])
            if fix.name not in names:
                names.append(fix.name)
    for key, names in wrapping.items():
        order = WRAP_ORDER.get(key)
        if order is None and len(names) > 1:
            raise SeamOrderError(
                f"{key} is wrapped by {', '.join(names)}, and trl_vlm_fixes/seams.py declares no order for it: add "
                f"WRAP_ORDER[{key!r}] = (...), the fixes innermost (wrapped first) first"
            )
        for name in names:
            if order is not None and name not in order:
                raise SeamOrderError(
                    f"fix {name} wraps {key}, a seam whose order trl_vlm_fixes/seams.py declares as {order} (innermost "
                    f"first) without it: add {name!r} to WRAP_ORDER[{key!r}] at the place its wrapper must take"
                )
