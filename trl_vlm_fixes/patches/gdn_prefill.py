"""gdn_prefill: TRL's colocated engine runs Gated-DeltaNet prefill on vLLM's Triton/FLA kernel, not FlashInfer's.

vLLM 0.25.1 on Hopper (SM90) picks FlashInfer 0.6.13's GDN prefill kernel by default, and that kernel is reported to
hang Qwen3.5 runs after hours (flashinfer-ai/flashinfer#3986, #2623 "Kernel hang in gdn_prefill_sm90", "Barrier error
detected. Missing wait"; vllm-project/vllm#38916, gone with Triton). FlashInfer 0.6.14 (first pinned by vLLM 0.26.0)
replaced it with a CuTe-DSL kernel, on which the hang no longer reproduces (flashinfer#3329): from there the fix is
``not-needed`` (``kernel_gone_reason``). Prefill never runs inside a CUDA graph, so no ``cudagraph_mode`` avoids it;
``gdn_prefill_backend`` does.
The value is added at TRL's ``LLM(...)`` call (colocated and ``trl vllm-serve``, neither of which passes one),
by the core's one wrapper per engine builder (as ``cudagraph``'s), and only for models that have Gated-DeltaNet
layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from packaging.version import Version

from ..declaration import Fix, ServerAdvice, VersionBound
from ..engine_args import EngineBuild, EngineContribution, gated_deltanet_scope, serves_gated_deltanet
from ..plan_rules import gated_deltanet_engine
from ..protection import Level
from ..registry import active, value
from ..server_flags import command_options
from ..switches import choice
from ..versions import installed_version, public_version
from ..vllm_arguments import engine_argument_problem

VALID_BACKENDS = ("triton", "flashinfer")
DEFAULT_BACKEND = "triton"
PROTECTED_BACKEND = "triton"  # after an engine hang (protection.Level.ENGINE_HANG), whatever was selected
BACKEND = choice(
    "backend", "TRL_VLM_FIXES_GDN_PREFILL_BACKEND", VALID_BACKENDS, DEFAULT_BACKEND, "a GDN prefill backend we select"
)
BACKEND_VARIABLE = BACKEND.variable


def selected_backend() -> str:
    """The backend read at apply() (TRL_VLM_FIXES_GDN_PREFILL_BACKEND, or apply(gdn_prefill={"backend": ...}))."""
    return str(value("gdn_prefill", BACKEND.key))


def contribute(kwargs: dict[str, Any], build: EngineBuild) -> None:
    """Select the prefill backend (Triton after an engine hang, whatever was selected: the documented cause)."""
    selected = selected_backend()
    backend = build.setting("gdn_prefill", BACKEND.key, selected)
    kwargs["gdn_prefill_backend"] = backend
    note = "FlashInfer's SM90 kernel is reported to hang" if backend == "triton" else "reported to hang on Hopper"
    if backend != selected:
        note = f"{BACKEND_VARIABLE}={selected} moved to Triton after an engine hang: {note}"
    build.changes.append(f"gdn_prefill_backend={backend} ({note}; {BACKEND_VARIABLE} to choose)")


def arguments_problem() -> str | None:
    """Why the installed vLLM would refuse ``gdn_prefill_backend`` (the selected value, or triton after an engine
    hang), read from its own ``EngineArgs``."""
    return engine_argument_problem("gdn_prefill_backend", selected_backend()) or engine_argument_problem(
        "gdn_prefill_backend", PROTECTED_BACKEND
    )


def read_back(engine: Any) -> tuple[str, list[str]] | None:
    """The backend the built engine's config carries (vLLM reads it from ``additional_config``)."""
    config = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    additional = getattr(config, "additional_config", None)
    if not isinstance(additional, dict):
        return None
    return f"gdn_prefill_backend={additional.get('gdn_prefill_backend', 'auto')}", []


# The first FlashInfer without the SM90 C++ prefill kernel that hangs, and the first vLLM that pins it
FIXED_FLASHINFER = "0.6.14"
FIXED_VLLM = "0.26.0"
# where the hang exists: a vLLM before the pin, or an older FlashInfer installed (``kernel_gone_reason`` asks them)
HANG_VERSIONS = (VersionBound("vllm", FIXED_VLLM), VersionBound("flashinfer-python", FIXED_FLASHINFER))


def kernel_gone_reason() -> str | None:
    """Why the reported hang cannot happen with the installed versions: FlashInfer 0.6.14 removed the SM90 C++
    ``gdn_prefill_sm90`` kernel (flashinfer-ai/flashinfer#3477 rewrote it in CuTe-DSL; #3329: the hang no longer
    reproduces there) and vLLM pins FlashInfer >= 0.6.14 from 0.26.0. The installed FlashInfer decides when there is
    one (a downgrade under ``--no-deps`` keeps the fix); without one, vLLM's pin does. A backend the user asked
    for (``TRL_VLM_FIXES_GDN_PREFILL_BACKEND`` set) is honoured everywhere: the fix then stays applied."""
    if active().chosen("gdn_prefill", BACKEND.key):
        return None
    vllm = installed_version("vllm")
    if vllm is None or Version(public_version(vllm)) < Version(FIXED_VLLM):
        return None
    flashinfer = installed_version("flashinfer-python")
    if flashinfer is not None and Version(public_version(flashinfer)) < Version(FIXED_FLASHINFER):
        return None
    flashinfer_text = f"FlashInfer {flashinfer}" if flashinfer else f"the FlashInfer >= {FIXED_FLASHINFER} it pins"
    return (
        f"vLLM {vllm} with {flashinfer_text}: FlashInfer {FIXED_FLASHINFER} replaced the SM90 GDN prefill kernel "
        f"reported to hang (flashinfer-ai/flashinfer#3477, #3329); set {BACKEND_VARIABLE}=triton to use Triton anyway"
    )


scope = gated_deltanet_scope  # no engine without vLLM; untouched for a model without GDN layers


def server_advice(argv: Sequence[str]) -> ServerAdvice:
    """In vLLM's own server exec'd by ``trl vllm-serve``: the prefill backend as its flag, where the kernel is still
    there and the command names no backend."""
    if kernel_gone_reason() is not None or "--gdn-prefill-backend" in dict(command_options(argv)):
        return ServerAdvice()
    return ServerAdvice(flags=(f"--gdn-prefill-backend {selected_backend()}",))


FIX = Fix(
    name="gdn_prefill",
    summary="colocated vLLM engine runs Gated-DeltaNet prefill on Triton (FlashInfer SM90 prefill hang)",
    packages=("trl", "vllm"),
    engine=EngineContribution(
        contribute,
        serves_gated_deltanet,
        arguments_problem,
        upstream_fixed=kernel_gone_reason,
        read_back=read_back,
    ),
    settings=(BACKEND,),
    selftest="trl_vlm_fixes.selftest.checks.gdn_prefill:check",
    scope=scope,
    applicability=gated_deltanet_engine(*HANG_VERSIONS),
    protected=((Level.ENGINE_HANG, "backend", PROTECTED_BACKEND),),
    server_advice=server_advice,
)
