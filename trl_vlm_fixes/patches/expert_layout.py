"""expert_layout: the experts TRL pushes into its engine land in the layout vLLM's MoE kernel reads.

TRL pushes trained weights with ``model.load_weights([(name, tensor)])``: each tensor lands where vLLM's loader puts a
checkpoint tensor, and vLLM's post-load step (``process_weights_after_loading``), which converts the experts into the
layout of the MoE backend's kernel, never runs again. On Triton (vLLM's choice on Hopper and Ampere) that step
changes nothing, and the push lands exactly (``tests/test_moe_weight_push.py``: every vLLM parameter equal to the
trainer's, with and without PEFT). FlashInfer's CUTLASS and TRTLLM backends (vLLM's default on Blackwell with
FlashInfer, which vLLM's wheel depends on), ROCm's AITER and MoonEP rearrange the experts in that step: every rollout
after a push would run on experts in the wrong layout, with no error (vllm-project/vllm#42821; measured on the CPU
with vLLM's own CUTLASS post-load step: both ``w13`` tensors wrong after TRL's push).

So where vLLM would pick such a backend by default, the engine TRL builds for a model with routed experts is given
``moe_backend="triton"``; where the caller asked for one by name (or vLLM would still pick one), the build stops with
one error naming the backend and the setting to change. Models without routed experts, and engines whose backend
keeps the pushed layout, are left as they are, and the engine's log line says why. Which backend vLLM picks is
replayed from vLLM's own rules (``trl_vlm_fixes/moe_backend.py``, checked against vLLM's oracle on simulated GPUs).
"""

from __future__ import annotations

from typing import Any

from ..declaration import VLLM_MODES, Applicability, Fix, Plan
from ..engine_args import EngineBuild, EngineContribution, served_model_config
from ..logs import fix_logger
from ..moe_backend import (
    REARRANGING_BACKENDS,
    expected_moe_backend,
    expert_backend_argument,
    fused_expert_layout_problem,
    has_routed_experts,
    rearranging_moe_backend,
)
from ..vllm_arguments import engine_argument_problem

LOGGER = fix_logger(__name__)

NO_ROUTED_EXPERTS = "has no routed experts"


class ExpertLayoutError(RuntimeError):
    """The engine would run the experts on a backend that rearranges them after loading, and was asked for it."""


def serves_routed_experts(build: EngineBuild) -> bool:
    return has_routed_experts(build.model_config)


def kept_layout(kwargs: dict[str, Any], model_config: Any) -> str | None:
    """Why the engine built with ``kwargs`` leaves the pushed experts as they are (the fix then steps aside), or None
    where vLLM would run them on a backend that rearranges them after loading."""
    expected = expected_moe_backend(kwargs, model_config)
    if expected is None:
        return "vLLM's MoE backend is not chosen from a CUDA or ROCm GPU here (no rearranging backend)"
    backend, why = expected
    if backend not in REARRANGING_BACKENDS:
        return f"vLLM runs the experts on {backend} ({why}), which keeps the layout TRL's push writes"
    if rearranging_moe_backend(kwargs, model_config) is None:
        return "quantized experts: vLLM's quantized MoE backends are not replayed here (unproven, left as upstream)"
    return None


def contribute(kwargs: dict[str, Any], build: EngineBuild) -> None:
    """Pin Triton where vLLM's default would rearrange the experts; refuse a rearranging backend asked for by name."""
    if transposed := fused_expert_layout_problem(build.model_config):  # loud, at the first push: said up front
        LOGGER.warning("%s", f"TRL's weight push into this engine will fail: {transposed}")
    if (kept := kept_layout(kwargs, build.model_config)) is not None:
        build.stepped_aside.append(("expert_layout", kept))
        return
    problem = rearranging_moe_backend(kwargs, build.model_config)
    pinned = {**kwargs, **expert_backend_argument()}
    requested = kwargs.get("moe_backend") or (kwargs.get("kernel_config") or {}).get("moe_backend")
    if requested in (None, "auto") and rearranging_moe_backend(pinned, build.model_config) is None:
        expected = expected_moe_backend(kwargs, build.model_config)
        backend = expected[0] if expected else "?"
        kwargs.update(expert_backend_argument())
        build.changes.append(
            f"moe_backend=triton (vLLM's default here, {backend}, rearranges the experts after loading, so TRL's "
            "weight push would leave them in the wrong layout)"
        )
        return
    raise ExpertLayoutError(
        f"{problem}. (TRL_VLM_FIXES_EXPERT_LAYOUT=0 builds it anyway: every push then leaves the experts wrong.)"
    )


def arguments_problem() -> str | None:
    """Why the installed vLLM would refuse ``moe_backend="triton"``, read from its own ``EngineArgs``."""
    return engine_argument_problem("moe_backend", expert_backend_argument()["moe_backend"])


def _model(engine: Any) -> Any:
    """The in-process model of a colocated engine (where TRL's ``sync_weights`` pushes to), or None."""
    executor = getattr(getattr(engine, "llm_engine", None), "model_executor", None)
    return getattr(getattr(getattr(executor, "driver_worker", None), "model_runner", None), "model", None)


def read_back(engine: Any) -> tuple[str, list[str]] | None:
    """The backends the built engine's expert layers run (their ``quant_method``), else the ``moe_backend`` its
    config carries; a warning where a layer rearranges what a push writes."""
    model = _model(engine)
    backends = set()
    for _, module in model.named_modules() if hasattr(model, "named_modules") else ():
        backend = getattr(getattr(getattr(module, "quant_method", None), "unquantized_backend", None), "name", None)
        if backend is not None:
            backends.add(str(backend))
    if backends:
        wrong = sorted(backends & set(REARRANGING_BACKENDS))
        warnings = (
            [
                f"expert_layout: the engine's experts run on {', '.join(wrong)}, which rearranges them after loading: "
                "TRL's weight pushes will leave them in the wrong layout"
            ]
            if wrong
            else []
        )
        return f"MoE backend={','.join(sorted(backends))}", warnings
    config = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    kernel = getattr(config, "kernel_config", None)
    if kernel is None:
        return None
    return f"moe_backend={getattr(kernel, 'moe_backend', 'auto')}", []


def scope(trainer: Any) -> str | None:
    """The engine TRL builds for this trainer: none without vLLM; untouched for a model without routed experts, or
    where vLLM's backend keeps the pushed layout (decided where the engine is built: the server's own GPU in server
    mode)."""
    if not getattr(trainer, "use_vllm", False):
        return "use_vllm is off: no vLLM engine"
    config = served_model_config(trainer, {})
    if not has_routed_experts(config):
        return f"the served model {NO_ROUTED_EXPERTS}"
    if getattr(getattr(trainer, "args", None), "vllm_mode", "colocate") == "server":
        return None
    return kept_layout({}, config)


def served_routed_experts(plan: Plan) -> str | None:
    """``scope`` before the trainer exists, past the mode: routed experts in the config; in colocate mode, where
    ``plan.here``, the backend vLLM would pick on this machine (server mode: decided on the server's GPU)."""
    if not has_routed_experts(plan.config):
        return f"the served model {NO_ROUTED_EXPERTS}"
    if plan.mode == "server" or not plan.here:
        return None
    return kept_layout({}, plan.config)


FIX = Fix(
    name="expert_layout",
    summary="experts pushed into the colocated vLLM engine land in the layout its MoE kernel reads (Triton where "
    "vLLM's default would rearrange them after loading)",
    packages=("trl", "vllm"),
    engine=EngineContribution(
        contribute, serves_routed_experts, arguments_problem, read_back=read_back, aside=NO_ROUTED_EXPERTS
    ),
    selftest="trl_vlm_fixes.selftest.checks.expert_layout:check",
    scope=scope,
    applicability=Applicability(
        modes=VLLM_MODES,
        aside={"none": "no vLLM engine"},
        families=("qwen3_5_moe", "qwen3_vl_moe"),
        checkpoint=served_routed_experts,
    ),
)
