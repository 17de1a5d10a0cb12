"""gdn_prefill: TRL's colocated engine runs Gated-DeltaNet prefill on vLLM's Triton/FLA kernel, not FlashInfer's.

vLLM 0.25.1 on Hopper (SM90) picks FlashInfer 0.6.13's GDN prefill kernel by default, and that kernel is reported to
hang Qwen3.5 runs after hours (flashinfer-ai/flashinfer#3986, #2623 "Kernel hang in gdn_prefill_sm90", "Barrier error
detected. Missing wait"; vllm-project/vllm#38916, gone with Triton). FlashInfer replaced it in 0.6.14 (first pinned by
vLLM 0.26.0). Prefill never runs inside a CUDA graph, so no ``cudagraph_mode`` avoids it; ``gdn_prefill_backend`` does.
The value is added at TRL's ``LLM(...)`` call (colocated and ``trl vllm-serve``, neither of which passes one),
through the same mechanism as ``cudagraph``, and only for models that have Gated-DeltaNet layers.
"""

from __future__ import annotations

from typing import Any

from ..engine_args import EngineBuild, engine_builder_targets, serves_gated_deltanet
from ..registry import Fix
from ..switches import read_choice
from .watchdog.resume import protected_after_repeated_hang

BACKEND_VARIABLE = "TRL_VLM_FIXES_GDN_PREFILL_BACKEND"
VALID_BACKENDS = ("triton", "flashinfer")
DEFAULT_BACKEND = "triton"
PROTECTED_BACKEND = "triton"  # after a hang repeated at one step (watchdog.resume)


class GdnPrefillBackendError(ValueError):
    """TRL_VLM_FIXES_GDN_PREFILL_BACKEND names no backend we accept."""


def selected_backend() -> str:
    """The backend from TRL_VLM_FIXES_GDN_PREFILL_BACKEND (default triton); anything else fails at once."""
    return read_choice(
        BACKEND_VARIABLE, VALID_BACKENDS, DEFAULT_BACKEND, GdnPrefillBackendError, "a GDN prefill backend we select"
    )


def contribute(kwargs: dict[str, Any], build: EngineBuild) -> None:
    """Select the prefill backend."""
    backend = PROTECTED_BACKEND if protected_after_repeated_hang() else selected_backend()
    kwargs["gdn_prefill_backend"] = backend
    note = "FlashInfer's SM90 kernel is reported to hang" if backend == "triton" else "reported to hang on Hopper"
    build.changes.append(f"gdn_prefill_backend={backend} ({note}; {BACKEND_VARIABLE} to choose)")


FIX = Fix(
    name="gdn_prefill",
    summary="colocated vLLM engine runs Gated-DeltaNet prefill on Triton (FlashInfer SM90 prefill hang)",
    packages=("trl", "vllm"),
    targets=engine_builder_targets("gdn_prefill", contribute, acts_on=serves_gated_deltanet),
)
