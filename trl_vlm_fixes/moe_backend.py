"""Does the engine TRL is about to build run the experts on a vLLM MoE backend that rearranges them after loading?

TRL pushes trained weights into its colocated engine with ``model.load_weights([(name, tensor)])``: each tensor lands
in the layout vLLM's weight loader gives a checkpoint tensor, and nothing runs afterwards. vLLM builds an engine as
load, then ``process_weights_after_loading``; for unquantized experts that step converts ``w13_weight``/``w2_weight``
into the layout of the backend's kernel (``convert_to_unquantized_kernel_format``, vLLM 0.25.1
``fused_moe/oracle/unquantized.py``):

- Triton (vLLM's choice on Hopper, SM90, and wherever FlashInfer is missing): ``.contiguous()`` only, so a push lands
  exactly (measured on the CPU with vLLM's own model classes: ``tests/test_moe_weight_push.py``);
- FlashInfer CUTLASS (default on SM120 with FlashInfer, on SM100 when TRTLLM is unavailable, or asked for): swaps
  the halves of ``w13`` to ``[up; gate]`` (``swap_w13_to_w31``): a push leaves ``[gate; up]``, silently (same shape);
- FlashInfer TRTLLM (default on SM100 with FlashInfer): permutes ``w13``/``w2`` into its block layout;
- ROCm AITER (``VLLM_ROCM_USE_AITER=1``): shuffles both; MoonEP (vLLM 0.31, ``all2all_backend="moonep"``): regathers.

vllm-project/vllm#42821. The backend is chosen by vLLM's oracle (``select_unquantized_moe_backend``) from the
platform, the compute capability, FlashInfer's presence, the engine's ``moe_backend`` (or ``kernel_config``),
``enable_lora``, ``data_parallel_size`` and, on ROCm, ``VLLM_ROCM_USE_AITER``. ``expected_moe_backend`` replays that
choice, torch-free at import (vLLM is asked at call time, when TRL is about to build the engine anyway);
``tests/test_moe_backend.py`` checks it against vLLM's own oracle on simulated GPUs. Pinning ``moe_backend="triton"``
(an ``EngineArgs`` field in vLLM 0.25.1 and 0.31.0) makes every push land exactly.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The backends whose post-load step rearranges unquantized expert weights (vLLM's UnquantizedMoeBackend names)
REARRANGING_BACKENDS = {
    "FLASHINFER_TRTLLM": "FlashInfer TRTLLM (permutes w13/w2 into its block layout)",
    "FLASHINFER_CUTLASS": "FlashInfer CUTLASS (swaps the gate and up halves of w13)",
    "AITER": "ROCm AITER (shuffles w13/w2)",
    "MOONEP": "MoonEP (regathers the experts into its own layout)",
}
# vLLM's `moe_backend` values for unquantized experts (map_unquantized_backend) and the oracle's names for them
_ARGUMENT_BACKENDS = {
    "triton": "TRITON",
    "batched_triton": "BATCHED_TRITON",  # vLLM 0.31 only
    "flashinfer_trtllm": "FLASHINFER_TRTLLM",
    "flashinfer_cutlass": "FLASHINFER_CUTLASS",
    "aiter": "AITER",
}
_SAFE_ARGUMENT = "triton"
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_backend_argument() -> dict[str, str]:
    """The ``LLM(...)`` keyword that selects Triton for unquantized experts, whose post-load step leaves the loader's
    layout (vLLM 0.25.1 and 0.31.0: ``EngineArgs.moe_backend`` -> ``KernelConfig.moe_backend``; an explicit backend
    is honoured before any platform default or ``VLLM_ROCM_USE_AITER``). ``vllm serve``: ``--moe-backend triton``."""
    return {"moe_backend": _SAFE_ARGUMENT}


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def _text_config(model_config: Any) -> Any:
    """The language model's config of a transformers config, a config.json dict or a vLLM ``ModelConfig``."""
    config = _get(model_config, "hf_config") or model_config  # a vLLM ModelConfig holds the transformers config
    return _get(config, "text_config") or config


def has_routed_experts(model_config: Any) -> bool:
    """Does the served model have routed experts (a positive expert count in its text config)?"""
    if model_config is None:
        return False
    text = _text_config(model_config)
    for field in _EXPERT_COUNT_FIELDS:
        value = _get(text, field)
        if isinstance(value, int) and value > 0:
            return True
    return False


def _quantized(engine_kwargs: Mapping[str, Any], model_config: Any) -> bool:
    config = _get(model_config, "hf_config") or model_config
    return bool(engine_kwargs.get("quantization") or _get(config, "quantization_config"))


def _requested(engine_kwargs: Mapping[str, Any]) -> str:
    """The ``moe_backend`` the engine is asked for, as vLLM normalises it (``KernelConfig``), or ``auto``."""
    value = engine_kwargs.get("moe_backend")
    if value in (None, "auto"):
        value = _get(engine_kwargs.get("kernel_config") or {}, "moe_backend")
    return str(value or "auto").lower().replace("-", "_")


def _capability(platform: Any) -> str:
    capability = platform.get_device_capability()
    return f"{capability.major}.{capability.minor}" if capability is not None else "unknown"


def expected_moe_backend(engine_kwargs: Mapping[str, Any], model_config: Any) -> tuple[str, str] | None:
    """(the oracle's name of the unquantized MoE backend the engine would pick, why) as vLLM 0.25.1 / 0.31.0's
    ``select_unquantized_moe_backend`` decides it on this machine; None where it is not determined here: no vLLM, or
    a platform other than CUDA and ROCm (CPU, XPU, TPU, out-of-tree: not where TRL trains with a colocated engine).
    Not replayed: ``VLLM_BATCH_INVARIANT`` and the routing-method checks (every Qwen MoE routes by softmax top-k,
    which all of these backends take)."""
    try:
        from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle
        from vllm.platforms import current_platform as platform
    except Exception:  # noqa: BLE001 - no vLLM (or none that imports): nothing to determine
        return None
    if not (platform.is_cuda() or platform.is_rocm()):
        return None
    members = set(oracle.UnquantizedMoeBackend.__members__)
    text = _text_config(model_config)
    activation = "swigluoai" if _get(text, "model_type") == "gpt_oss" else str(_get(text, "hidden_act") or "silu")
    data_parallel = int(engine_kwargs.get("data_parallel_size") or 1)
    expert_parallel = bool(engine_kwargs.get("enable_expert_parallel"))
    trtllm = (
        platform.is_cuda()
        and platform.is_device_capability_family(100)
        and activation in ("silu", "relu2_no_mul")
        and not engine_kwargs.get("enable_eplb")
        and _flashinfer("has_flashinfer_trtllm_fused_moe")
    )
    cutlass = (
        platform.is_cuda()
        and (
            platform.is_device_capability(90)
            or platform.is_device_capability_family(100)
            or platform.is_device_capability_family(120)
        )
        and platform.has_device_capability(90)
        and activation in ("silu", "gelu_tanh", "relu2_no_mul", "swigluoai")
        and _flashinfer("has_flashinfer_cutlass_fused_moe")
    )

    if engine_kwargs.get("enable_lora"):
        # 0.31 routes LoRA to FlashInfer TRTLLM's LoRA experts where they fit (_trtllm_bf16_lora_supported)
        intermediate = _get(text, "moe_intermediate_size") or _get(text, "intermediate_size") or 0
        per_rank = int(intermediate) // int(engine_kwargs.get("tensor_parallel_size") or 1)
        if hasattr(oracle, "_trtllm_bf16_lora_supported") and trtllm and per_rank % 128 == 0:
            return "FLASHINFER_TRTLLM", f"vLLM's LoRA MoE path on compute capability {_capability(platform)}"
        return "TRITON", "vLLM's LoRA MoE path"
    moonep = expert_parallel and data_parallel > 1 and engine_kwargs.get("all2all_backend") == "moonep"
    if "MOONEP" in members and moonep:
        return "MOONEP", 'all2all_backend="moonep" was passed'
    requested = _requested(engine_kwargs)
    if requested not in ("auto", "humming"):
        backend = _ARGUMENT_BACKENDS.get(requested)
        return (backend, f"moe_backend={requested!r} was passed") if backend in members else None
    if platform.is_rocm():
        from vllm._aiter_ops import rocm_aiter_ops

        if rocm_aiter_ops.is_fused_moe_enabled():
            return "AITER", "VLLM_ROCM_USE_AITER=1 and VLLM_ROCM_USE_AITER_MOE on"
        return "TRITON", "vLLM's default on ROCm without AITER"
    order = ["FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS", "TRITON"]
    if platform.is_device_capability_family(90):  # FlashInfer is slower than Triton on Hopper
        order = ["TRITON", "FLASHINFER_TRTLLM", "FLASHINFER_CUTLASS"]
    if data_parallel > 1:
        order.append(order.pop(order.index("FLASHINFER_CUTLASS")))
    if activation == "swigluoai":
        order = ["TRITON"] + [name for name in order if name != "TRITON"]
    supported = {"FLASHINFER_TRTLLM": trtllm, "FLASHINFER_CUTLASS": cutlass, "TRITON": True}
    backend = next(name for name in order if supported[name])
    why = f"vLLM's default on compute capability {_capability(platform)}"
    return backend, why + (" with FlashInfer installed" if backend != "TRITON" else "")


def _flashinfer(probe: str) -> bool:
    """vLLM's own check that FlashInfer's fused-MoE kernels are installed (``vllm.utils.flashinfer``)."""
    try:
        from vllm.utils import flashinfer
    except Exception:  # noqa: BLE001 - no FlashInfer helpers: no FlashInfer backend either
        return False
    return bool(getattr(flashinfer, probe, lambda: False)())


def rearranging_moe_backend(engine_kwargs: Mapping[str, Any], model_config: Any) -> str | None:
    """One sentence naming the backend and the setting to change when the engine built with ``engine_kwargs`` (its
    ``LLM(...)`` keyword arguments, with the process environment) would run this model's experts on a backend that
    rearranges them after loading; None for a model without routed experts, a backend that keeps the loader's layout
    (Triton), a quantized model (its experts go through other oracles: fp8, mxfp4...; not determined here), or
    where ``expected_moe_backend`` cannot tell (no vLLM, a platform other than CUDA/ROCm)."""
    if not has_routed_experts(model_config) or _quantized(engine_kwargs, model_config):
        return None
    expected = expected_moe_backend(engine_kwargs, model_config)
    if expected is None or expected[0] not in REARRANGING_BACKENDS:
        return None
    backend, why = expected
    return (
        f"vLLM would run this model's experts on its {REARRANGING_BACKENDS[backend]} MoE backend ({why}), which "
        "rearranges the expert weights after loading while TRL's weight push writes them in the checkpoint layout "
        "and never re-runs that step (vllm-project/vllm#42821), so every rollout after a push would use scrambled "
        f"experts: build the engine with moe_backend={_SAFE_ARGUMENT!r} (vllm serve: --moe-backend {_SAFE_ARGUMENT})"
    )


def fused_expert_layout_problem(model_config: Any) -> str | None:
    """Why TRL's push of a Qwen3-VL-MoE's fused experts fails with the installed vLLM, or None. transformers 5 holds
    them as ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]; the released checkpoints store them transposed,
    and vLLM >= 0.26 (``Qwen3VLMoeDecoderLayer`` passes ``is_fused_checkpoint_transposed=True``, vLLM PR 47058)
    transposes every fused expert tensor it is given, so the first pushed ``down_proj`` fails with a size mismatch
    (verl-project/verl#6210). vLLM 0.25.1 tells the layouts apart by shape and takes both. Read from vLLM's source
    file, never imported."""
    config = _get(model_config, "hf_config") or model_config
    if model_config is None or _get(config, "model_type") != "qwen3_vl_moe":
        return None
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "model_executor" / "models" / "qwen3_vl_moe.py"
    try:
        transposes = "is_fused_checkpoint_transposed=True" in source.read_text()
    except OSError:
        return None
    if not transposes:
        return None
    return (
        "the installed vLLM transposes every fused Qwen3-VL-MoE expert tensor it loads (is_fused_checkpoint_"
        "transposed=True in qwen3_vl_moe.py: the released checkpoints' layout), but transformers 5 holds them as "
        "gate_up_proj [E, 2I, H] and down_proj [E, H, I], so TRL's push of the trained experts fails with a size "
        "mismatch; push them transposed (.transpose(1, 2)) or use vLLM 0.25.1, which tells the layouts apart by shape"
    )


def rerun_expert_post_load(model: Any) -> list[str]:
    """Re-run vLLM's own post-load step on every MoE layer whose backend rearranges its weights (the names of those
    layers). Right only after a push that replaced all of a layer's ``w13_weight`` and ``w2_weight`` (TRL pushes
    transformers 5's fused ``gate_up_proj``/``down_proj`` whole): weights not pushed since the last conversion would
    be converted twice. Measured exact on the CPU for FlashInfer CUTLASS (vLLM 0.25.1 and 0.31.0); TRTLLM's and
    AITER's conversions need their GPU libraries and are untested here."""
    processed = []
    for name, module in model.named_modules():
        method: Any = getattr(module, "quant_method", None)
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if method is not None and backend in REARRANGING_BACKENDS:
            method.process_weights_after_loading(module)
            processed.append(name)
    return processed
