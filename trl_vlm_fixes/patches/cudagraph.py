"""cudagraph: build TRL's colocated vLLM engine without CUDA graphs (or with the mode the user selects).

A hang of CUDA-graph decode of Qwen3.5's Gated-DeltaNet layers was reported to this project (GPU at 100%, CPU idle,
SIGTERM ignored) but not reproduced; the documented hang on Hopper is FlashInfer's GDN prefill (see ``gdn_prefill``),
which runs outside graphs. ``NONE`` stays the default for models with Gated-DeltaNet layers, at a measured 3.1-3.9x
decode cost; ``compilation_config={"cudagraph_mode": "NONE"}`` keeps torch.compile and drops only the graphs. The value
is injected at the ``LLM(...)`` call TRL makes, so vLLM builds (and hashes) one consistent configuration; nothing is
mutated after the engine exists and ``enforce_eager`` is never touched.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..engine_args import EngineBuild, engine_builder_targets, serves_gated_deltanet
from ..registry import Fix
from ..switches import CUDAGRAPH_MODE_VARIABLE, read_choice

LOGGER = logging.getLogger("trl_vlm_fixes")

# vLLM 0.25.1's CUDAGraphMode names (checked against the real enum in the tests).
VALID_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
DEFAULT_MODE = "NONE"
# measured on an H200 (docs/gpu-results.md, section 3)
SPEED_NOTE = {
    "NONE": "no CUDA graphs: decode about 3-4x slower than vLLM's default graphs, about 2x faster than enforce_eager",
    "PIECEWISE": "piecewise graphs: decode about 2x slower than vLLM's default graphs",
    "FULL_DECODE_ONLY": "full graphs for decode only: the default's decode speed at batch 64, 1.3x slower at 16",
    "FULL": "full graphs",
    "FULL_AND_PIECEWISE": "vLLM's default graphs: the fastest decode",
}


class CudagraphModeError(ValueError):
    """TRL_VLM_FIXES_CUDAGRAPH_MODE names no CUDAGraphMode."""


def selected_mode() -> str:
    """The mode from TRL_VLM_FIXES_CUDAGRAPH_MODE (default NONE); anything else fails at once."""
    return read_choice(CUDAGRAPH_MODE_VARIABLE, VALID_MODES, DEFAULT_MODE, CudagraphModeError, "a vLLM CUDAGraphMode")


def contribute(kwargs: dict[str, Any], build: EngineBuild) -> None:
    """Merge the selected ``cudagraph_mode`` into the engine's compilation config."""
    mode = selected_mode()
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
        enum_type = _cudagraph_mode_enum(previous)
        return dataclasses.replace(existing, cudagraph_mode=enum_type[mode])  # type: ignore[type-var]
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


FIX = Fix(
    name="cudagraph",
    summary="colocated vLLM engine without CUDA graphs (a reported Gated-DeltaNet decode hang, not reproduced)",
    packages=("trl", "vllm"),
    targets=engine_builder_targets("cudagraph", contribute, acts_on=serves_gated_deltanet),
)
