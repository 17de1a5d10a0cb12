"""cudagraph: TRL's vLLM engine runs every Gated-DeltaNet kernel outside CUDA graphs (``PIECEWISE``), or as selected.

A hang of CUDA-graph replay of Qwen3.5's Gated-DeltaNet *decode* was reported to this project (GPU at 100%, CPU idle,
SIGTERM ignored) but not reproduced; the documented hang on Hopper is FlashInfer's GDN prefill (see ``gdn_prefill``).
In vLLM 0.25.1 ``vllm::qwen_gdn_attention_core`` (conv1d + recurrent attention, prefill and decode) is one of the
default splitting ops (``CompilationConfig._attention_ops``, ``set_splitting_ops_for_v1``): under ``PIECEWISE`` every
GDN kernel runs between the captured pieces, launched from Python at every step; only the projections, MLPs, norms
are replayed from graphs. Measured on an H200 with an 8.95B Qwen3.5 shape (docs/gpu-results.md, section 9): 0 GDN
calls during graph capture and 0.998 per step and GDN layer under ``PIECEWISE``, against 504 and 0.032 under vLLM's
default graphs. So ``PIECEWISE`` removes exactly what the report is about, at 0.79x the default's decode there (3,931
vs 4,960 tok/s), where ``NONE`` (selectable: nothing captured) costs far more. The value is injected at the
``LLM(...)`` call TRL makes, so vLLM builds (and hashes) one consistent configuration; nothing is mutated after the
engine exists and ``enforce_eager`` is never touched.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

from ..engine_args import EngineBuild, engine_builder_targets, serves_gated_deltanet
from ..registry import Fix
from ..switches import CUDAGRAPH_MODE_VARIABLE, read_choice
from ..vllm_arguments import cudagraph_mode_problem
from .watchdog.resume import protected_after_repeated_hang

LOGGER = logging.getLogger("trl_vlm_fixes")

# vLLM 0.25.1's CUDAGraphMode names (checked against the real enum in the tests).
VALID_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
DEFAULT_MODE = "PIECEWISE"
PROTECTED_MODE = "NONE"  # after a hang repeated at one step (watchdog.resume): nothing captured at all
# measured on an H200 (docs/gpu-results.md, sections 3 and 9)
SPEED_NOTE = {
    "NONE": "no CUDA graphs at all: decode about 3-4x slower than vLLM's default graphs",
    "PIECEWISE": (
        "every Gated-DeltaNet kernel outside CUDA graphs, the rest captured: decode 0.79x vLLM's default graphs at "
        "8.95B (0.5-0.6x on a 1.2B model)"
    ),
    "FULL_DECODE_ONLY": "full graphs for decode only: the default's decode speed at batch 64, 1.3x slower at 16",
    "FULL": "full graphs",
    "FULL_AND_PIECEWISE": "vLLM's default graphs: the fastest decode",
}


class CudagraphModeError(ValueError):
    """TRL_VLM_FIXES_CUDAGRAPH_MODE names no CUDAGraphMode."""


def selected_mode() -> str:
    """The mode from TRL_VLM_FIXES_CUDAGRAPH_MODE (default PIECEWISE); anything else fails at once."""
    return read_choice(CUDAGRAPH_MODE_VARIABLE, VALID_MODES, DEFAULT_MODE, CudagraphModeError, "a vLLM CUDAGraphMode")


def contribute(kwargs: dict[str, Any], build: EngineBuild) -> None:
    """Merge the selected ``cudagraph_mode`` into the engine's compilation config (``NONE`` after a repeated hang)."""
    mode = PROTECTED_MODE if protected_after_repeated_hang() else selected_mode()
    kwargs["compilation_config"] = merge_compilation_config(kwargs.get("compilation_config"), mode)
    build.changes.append(f"cudagraph_mode={mode} ({SPEED_NOTE[mode]}; {CUDAGRAPH_MODE_VARIABLE} to choose)")


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
            "trl_vlm_fixes.cudagraph: replacing cudagraph_mode=%s with %s (set %s to choose, or "
            "TRL_VLM_FIXES_CUDAGRAPH=0 to keep yours).",
            name,
            mode,
            CUDAGRAPH_MODE_VARIABLE,
        )


def arguments_problem() -> str | None:
    """Why the installed vLLM would refuse the modes this fix may pass (the selected one, and NONE after a repeated
    hang), read from its own ``EngineArgs``/``CompilationConfig``/``CUDAGraphMode``. A malformed setting is not a vLLM
    problem: it fails where it is read."""
    try:
        mode = selected_mode()
    except CudagraphModeError:
        mode = PROTECTED_MODE
    return cudagraph_mode_problem(mode) or cudagraph_mode_problem(PROTECTED_MODE)


FIX = Fix(
    name="cudagraph",
    summary="vLLM engine runs every Gated-DeltaNet kernel outside CUDA graphs (a reported GDN decode-graph hang)",
    packages=("trl", "vllm"),
    targets=engine_builder_targets("cudagraph", contribute, serves_gated_deltanet, arguments_problem),
)
