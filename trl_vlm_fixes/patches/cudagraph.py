"""cudagraph: TRL's vLLM engine keeps vLLM's own CUDA graphs until the watchdog has seen it hang; the engines built
after that in the same ``output_dir`` run every Gated-DeltaNet kernel outside CUDA graphs (``PIECEWISE``), and capture
nothing (``NONE``) after a second engine hang, at any step.

A hang of CUDA-graph replay of Qwen3.5's Gated-DeltaNet *decode* was reported to this project (GPU at 100%, CPU idle,
SIGTERM ignored) but never reproduced, and nothing public ties plain decode graphs to a hang; the hang documented for
this stack is FlashInfer's SM90 GDN prefill kernel, outside every graph in every mode (``gdn_prefill`` removes it).
``PIECEWISE`` costs on every step where it is not needed: decode 0.39x-0.77x vLLM's default graphs on a 2B-class Qwen3.5
shape at 16-256 requests per step, 0.75x-0.91x at 9B (H100; docs/gpu-results.md section 11). So by default the fix adds
nothing to the engine's ``compilation_config`` and arms the protection where a watched trainer builds the engine:
after a colocated generate whose engine made no progress (recorded in ``output_dir``'s protection state), every later
engine there is built ``PIECEWISE``: in vLLM 0.25.1
``vllm::qwen_gdn_attention_core`` (conv1d + recurrent attention, prefill and decode) is one of the default splitting ops
(``CompilationConfig._attention_ops``, ``set_splitting_ops_for_v1``), so every GDN kernel runs between the captured
pieces (measured on an H200, docs/gpu-results.md section 9: 0 GDN calls during graph capture and 0.998 per step and GDN
layer, against 504 and 0.032 under vLLM's default graphs); after a second engine hang, ``NONE``
(``protection.Level``, declared below). ``TRL_VLM_FIXES_CUDAGRAPH_MODE`` pins a mode from the first step; a hang can
only raise its protection (``PIECEWISE`` -> ``NONE``), never lower it. The value is injected at the ``LLM(...)`` call
TRL makes, so vLLM builds (and hashes) one consistent configuration; nothing is mutated after the engine exists and
``enforce_eager`` is never touched.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from .. import protection
from ..declaration import Fix, ServerAdvice
from ..engine_args import EngineBuild, EngineContribution, gated_deltanet_scope, serves_gated_deltanet
from ..logs import fix_logger
from ..plan_rules import gated_deltanet_engine
from ..protection import Level
from ..registry import value
from ..server_flags import command_options
from ..switches import SwitchValueError, choice
from ..vllm_arguments import cudagraph_mode_problem

LOGGER = fix_logger(__name__)

# vLLM 0.25.1's CUDAGraphMode names (checked against the real enum in the tests).
VALID_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
AUTO = "auto"  # vLLM's own mode until a hang is reported, then the protected modes below
DEFAULT_MODE = AUTO
HANG_MODE = "PIECEWISE"  # after an engine hang: every Gated-DeltaNet kernel outside the graphs
PROTECTED_MODE = "NONE"  # after a second engine hang (at any step): nothing captured at all
# NONE, FULL_DECODE_ONLY: measured on an H200 (docs/gpu-results.md, sections 3, 9); PIECEWISE: an H100 (section 11)
SPEED_NOTE = {
    "NONE": "no CUDA graphs at all: decode about 3-4x slower than vLLM's default graphs",
    "PIECEWISE": (
        "every Gated-DeltaNet kernel outside CUDA graphs, the rest captured: decode 0.39-0.77x vLLM's default graphs "
        "on a 2B-class Qwen3.5 at 16-256 requests per step, 0.75-0.91x at 9B"
    ),
    "FULL_DECODE_ONLY": "full graphs for decode only: the default's decode speed at batch 64, 1.3x slower at 16",
    "FULL": "full graphs",
    "FULL_AND_PIECEWISE": "vLLM's default graphs: the fastest decode",
}


MODE = choice(
    "mode", "TRL_VLM_FIXES_CUDAGRAPH_MODE", (AUTO, *VALID_MODES), DEFAULT_MODE, "auto or a vLLM CUDAGraphMode"
)
CudagraphModeError = SwitchValueError  # the same class: the name the tests import (a bad mode raises SwitchValueError)


def selected_mode() -> str:
    """The mode read at apply() (TRL_VLM_FIXES_CUDAGRAPH_MODE, or apply(cudagraph={"mode": ...}); auto)."""
    return str(value("cudagraph", MODE.key))


ARMED = (
    f"vLLM's own (protection armed: {HANG_MODE} after an engine hang, {PROTECTED_MODE} after a second; "
    f"{MODE.variable}={HANG_MODE} pins it from the first step)"
)


def not_armed(reason: str) -> str:
    """vLLM's own mode where no hang can raise it (no watched trainer builds the engine, or a server's engine)."""
    return f"vLLM's own (not protected: {reason}; {MODE.variable}={HANG_MODE} pins it from the first step)"


def contribute(kwargs: dict[str, Any], build: EngineBuild) -> None:
    """The selected mode, or the protection the state asks for (``build.setting``), merged into the engine's
    compilation config; with neither (``auto``, no hang), vLLM's own mode: nothing is added."""
    selected = selected_mode()
    mode = build.setting("cudagraph", MODE.key, selected)
    if mode == AUTO:
        build.why["cudagraph"] = f"vLLM's own mode: {build.protection.reason}"
        armed = build.protection.armed
        build.changes.append(f"cudagraph_mode={ARMED if armed else not_armed(build.protection.reason)}")
        return
    if mode == selected:
        build.why["cudagraph"] = f"{MODE.variable}={selected}"
    kwargs["compilation_config"] = merge_compilation_config(kwargs.get("compilation_config"), mode)
    build.changes.append(f"cudagraph_mode={mode} ({SPEED_NOTE[mode]}; {MODE.variable} to choose)")


def read_back(engine: Any) -> tuple[str, list[str]] | None:
    """The mode vLLM built (its ``vllm_config``), and a warning where a setting changes what the mode means."""
    config = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    compilation = getattr(config, "compilation_config", None)
    if compilation is None:
        return None
    built = getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode))
    warnings = []
    if getattr(getattr(config, "model_config", None), "enforce_eager", False) and built == "NONE":
        warnings.append(
            f"cudagraph: enforce_eager=True: vLLM captures no CUDA graph at all (cudagraph_mode NONE: "
            f"{SPEED_NOTE['NONE']}), whatever {MODE.variable} says; drop enforce_eager to get CUDA graphs."
        )
    breaks = gated_deltanet_op_breaks_graphs() if built == "PIECEWISE" and _breakable_cudagraph() else True
    if not breaks:
        captured = "IS captured" if breaks is False else "may be captured (vLLM's Qwen GDN op was not found)"
        warnings.append(
            "cudagraph: VLLM_USE_BREAKABLE_CUDAGRAPH=1: vLLM's breakable graphs break only at functions marked "
            f"@eager_break_during_capture (attention), and this vLLM's Gated-DeltaNet op is not one, so GDN decode "
            f"{captured} although cudagraph_mode=PIECEWISE. Unset VLLM_USE_BREAKABLE_CUDAGRAPH to keep GDN kernels "
            "out of graphs."
        )
    return f"cudagraph_mode={built}", warnings


GDN_OP = ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "qwen_gdn_attention_core")


@functools.cache
def gated_deltanet_op_breaks_graphs() -> bool | None:
    """Is vLLM's Qwen Gated-DeltaNet op a break point of its breakable CUDA graphs (decorated with
    ``@eager_break_during_capture``: vLLM 0.31 yes, 0.25.1 no)? Read from the installed vLLM's source, since the
    decorator only wraps when the variable was set at import; None where the op is not found."""
    module, name = GDN_OP
    try:
        spec = importlib.util.find_spec(module)
        with open(spec.origin or "", encoding="utf-8") as handle:  # type: ignore[union-attr]
            tree = ast.parse(handle.read())
    except (ImportError, AttributeError, OSError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            decorators = {ast.unparse(decorator) for decorator in node.decorator_list}
            return any(decorator.endswith("eager_break_during_capture") for decorator in decorators)
    return None


def _breakable_cudagraph() -> bool:
    try:
        import vllm.envs as envs

        return bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH)
    except Exception:  # noqa: BLE001 - vLLM unreadable: read the variable as vLLM does
        return os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH", "0").strip().lower() in ("1", "true")


def merge_compilation_config(existing: Any, mode: str) -> Any:
    """Add ``cudagraph_mode`` to whatever compilation config is there, keeping its other fields."""
    if existing is None:
        return {"cudagraph_mode": mode}
    if isinstance(existing, bool):
        raise TypeError(f"compilation_config={existing!r} is not a vLLM compilation config")
    if isinstance(existing, int):
        return {"mode": existing, "cudagraph_mode": mode}
    if isinstance(existing, dict):
        previous = existing.get("cudagraph_mode")
        _warn_override(previous, mode)
        return {**existing, "cudagraph_mode": mode}
    if dataclasses.is_dataclass(existing) and hasattr(existing, "cudagraph_mode"):
        previous = existing.cudagraph_mode
        _warn_override(previous, mode)
        # a copy with one field set: dataclasses.replace would re-validate every field, and vLLM's pydantic
        # CompilationConfig refuses its own defaults there (cudagraph_capture_sizes=None)
        merged = copy.deepcopy(existing)
        merged.cudagraph_mode = _cudagraph_mode_enum(previous)[mode]
        return merged
    raise TypeError(
        f"trl_vlm_fixes.cudagraph cannot merge into compilation_config of type {type(existing).__name__}; "
        f"pass an int, a dict or a vllm.config.CompilationConfig, or set TRL_VLM_FIXES_CUDAGRAPH=0."
    )


def _cudagraph_mode_enum(previous: Any) -> Any:
    if previous is not None and hasattr(type(previous), "__members__"):
        return type(previous)
    from vllm.config import CUDAGraphMode

    return CUDAGraphMode


def _warn_override(previous: Any, mode: str) -> None:
    name = getattr(previous, "name", previous)
    if previous is not None and str(name).upper() != mode:
        LOGGER.warning(
            "replacing cudagraph_mode=%s with %s (set %s to choose, or TRL_VLM_FIXES_CUDAGRAPH=0 to keep yours).",
            name,
            mode,
            MODE.variable,
        )


def arguments_problem() -> str | None:
    """Why the installed vLLM would refuse the modes this fix may pass (the selected one, and those a hang asks for),
    read from its own ``EngineArgs``/``CompilationConfig``/``CUDAGraphMode``."""
    modes = [mode for mode in (selected_mode(), HANG_MODE, PROTECTED_MODE) if mode != AUTO]
    return next((problem for mode in modes if (problem := cudagraph_mode_problem(mode))), None)


def compilation_flag(mode: str) -> str:
    """vLLM's server flag for ``cudagraph_mode`` (``trl vllm-serve`` forwards it)."""
    return f'--compilation-config \'{{"cudagraph_mode": "{mode}"}}\''


def sets_cudagraph_mode(options: list[tuple[str, str]]) -> bool:
    """A compilation config that sets ``cudagraph_mode``: as JSON (``--compilation-config``, ``-cc``) or dotted
    (``-cc.cudagraph_mode=...``, ``--compilation-config.cudagraph_mode ...``)."""
    for name, given in options:
        base, _, field = name.partition(".")
        dotted = field.replace("_", "-") == "cudagraph-mode"
        if base in ("--compilation-config", "-cc") and (dotted or "cudagraph_mode" in given):
            return True
    return False


def server_advice(argv: Sequence[str]) -> ServerAdvice:
    """In vLLM's own server exec'd by ``trl vllm-serve``: a pinned mode as its flag now; vLLM's own mode (``auto``)
    kept, with the flag that protects it after a hang; nothing where the command sets ``cudagraph_mode``."""
    if sets_cudagraph_mode(command_options(argv)):
        return ServerAdvice()
    mode = selected_mode()
    if mode != AUTO:
        return ServerAdvice(flags=(compilation_flag(mode),))
    return ServerAdvice(after_hang=compilation_flag(HANG_MODE), after_repeated_hang=PROTECTED_MODE)


scope = gated_deltanet_scope  # no engine without vLLM; untouched for a model without GDN layers


def engine_cudagraph_mode(config: Any) -> str:
    """The CUDA-graph mode an engine given ``compilation_config=config`` runs, as vLLM's own config resolves it."""
    try:
        from vllm.config import CompilationConfig
    except ImportError:
        mode = (config or {}).get("cudagraph_mode") if isinstance(config, dict) else None
        return str(mode or "vLLM default (graphs on)")
    resolved = CompilationConfig(**config) if isinstance(config, dict) else (config or CompilationConfig())
    # None: VllmConfig picks its default, FULL_AND_PIECEWISE on a GPU (measured on an H200, docs/gpu-results.md)
    return resolved.cudagraph_mode.name if resolved.cudagraph_mode is not None else "vLLM default (graphs on)"


def expected_mode(level: Level) -> str:
    """The mode an engine gets at ``level`` with the mode selected now, as vLLM's CompilationConfig names it."""
    mode = protection.protected_setting(FIX.protected, MODE.key, selected_mode(), level)
    return engine_cudagraph_mode(None) if mode == AUTO else mode


FIX = Fix(
    name="cudagraph",
    summary="vLLM engine keeps vLLM's CUDA graphs until an engine hang; then Gated-DeltaNet kernels outside them "
    "(PIECEWISE), none captured after a second hang at one step (NONE)",
    packages=("trl", "vllm"),
    engine=EngineContribution(contribute, serves_gated_deltanet, arguments_problem, read_back=read_back),
    settings=(MODE,),
    selftest="trl_vlm_fixes.selftest.checks.cudagraph:check",
    scope=scope,
    applicability=gated_deltanet_engine(),
    protected=((Level.ENGINE_HANG, "mode", HANG_MODE), (Level.REPEATED_HANG, "mode", PROTECTED_MODE)),
    server_advice=server_advice,
)
