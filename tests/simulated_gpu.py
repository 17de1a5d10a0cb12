"""A simulated GPU for vLLM's MoE backend choice: vLLM's platform object is given a CUDA class of a chosen compute
capability, and vLLM's FlashInfer probes are told FlashInfer's fused-MoE kernels are or are not installed. vLLM's own
``select_unquantized_moe_backend`` then decides on a real ``FusedMoEConfig`` (``oracle_choice``)."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import pytest

# A Qwen3.5-35B-A3B-shaped text config: what the oracle reads of a model is its expert shape and activation
QWEN35_MOE_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048,
    "moe_intermediate_size": 512,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "hidden_act": "silu",
}


def simulate_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], with_flashinfer: bool) -> None:
    """Make vLLM's platform a CUDA GPU of ``capability`` with or without FlashInfer's fused-MoE kernels, until
    ``monkeypatch`` is undone."""
    pytest.importorskip("vllm")
    import vllm.platforms as platforms
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum
    from vllm.utils import flashinfer

    # vLLM's MoE modules look at the platform when imported (CUDA kernels): imported on the real one first
    importlib.import_module("vllm.model_executor.layers.fused_moe.oracle.unquantized")
    experts = [_experts_module(name) for name in ("triton_moe", "trtllm_bf16_moe", "flashinfer_cutlass_moe")]
    experts.append(_experts_module("trtllm_lora_moe"))  # vLLM 0.31: FlashInfer TRTLLM's LoRA experts

    class SimulatedCuda(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"
        device_type = "cuda"
        dispatch_key = "CUDA"

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return f"simulated sm{capability[0]}{capability[1]}"

    monkeypatch.setattr(platforms.current_platform, "__class__", SimulatedCuda)
    probes = ("has_flashinfer_trtllm_fused_moe", "has_flashinfer_cutlass_fused_moe")
    for module in [flashinfer, *experts]:
        for probe in probes:
            if module is not None and hasattr(module, probe):
                monkeypatch.setattr(module, probe, lambda: with_flashinfer)


@pytest.fixture
def simulated_gpu(monkeypatch: pytest.MonkeyPatch) -> Callable[[tuple[int, int], bool], None]:
    """``simulate_gpu`` for the rest of the test."""
    pytest.importorskip("vllm")

    def simulate(capability: tuple[int, int], with_flashinfer: bool) -> None:
        simulate_gpu(monkeypatch, capability, with_flashinfer)

    return simulate


def _experts_module(name: str) -> Any:
    try:
        return importlib.import_module(f"vllm.model_executor.layers.fused_moe.experts.{name}")
    except ImportError:
        return None


def oracle_choice(engine_kwargs: dict[str, Any], text: dict[str, Any] = QWEN35_MOE_TEXT) -> str | None:
    """vLLM's own choice for a Qwen3.5-MoE layer (``text``: its text config) of an engine built with ``engine_kwargs``
    (None: vLLM refuses)."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    parallel = dataclasses.replace(
        FusedMoEParallelConfig.make_no_parallel(), dp_size=int(engine_kwargs.get("data_parallel_size", 1))
    )
    requested = engine_kwargs.get("moe_backend") or engine_kwargs.get("kernel_config", {}).get("moe_backend", "auto")
    config = FusedMoEConfig(
        num_experts=text["num_experts"],
        experts_per_token=text["num_experts_per_tok"],
        hidden_dim=text["hidden_size"],
        intermediate_size=text["moe_intermediate_size"],
        num_local_experts=text["num_experts"],
        num_logical_experts=text["num_experts"],
        activation=MoEActivation.SILU,
        device="cuda",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
        moe_backend=requested.lower().replace("-", "_"),
        is_lora_enabled=bool(engine_kwargs.get("enable_lora")),
    )
    try:
        backend, _ = oracle.select_unquantized_moe_backend(config)
    except (ValueError, NotImplementedError):
        return None
    return str(backend.name)
