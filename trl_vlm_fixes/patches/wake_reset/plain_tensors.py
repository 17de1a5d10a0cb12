"""The tensors of a vLLM model that a level-2 wake leaves undefined and nothing rewrites: found, and put back.

vLLM 0.25.1 builds the model inside the "weights" pool of its ``CuMemAllocator`` (``Worker.load_model``). A level-2
sleep releases every allocation of that pool with no backup; the wake maps new pages, whose contents are whatever the
driver hands out. The worker then restores the model's named buffers (``Worker.wake_up``), and a weight push (or
``reload_weights``) rewrites every parameter. A tensor that is neither, but that a forward reads, keeps the new pages'
contents. In the model classes of the supported families (read, and scanned on the CPU by
``tests/test_every_tensor.py``) there are three kinds:

- Qwen3-VL's and Qwen3-VL-MoE's ``deepstack_input_embeds``: a list of ``[max_num_batched_tokens, hidden]`` tensors
  made with ``torch.zeros`` at build (``qwen3_vl.py`` ``Qwen3VLForConditionalGeneration.__init__``,
  ``qwen3_vl_moe.py``); ``forward`` adds rows ``[:num_tokens]`` of each to the hidden states after the first text
  layers on every step, and only an image step rewrites (then zeroes) its own ``[:num_tokens]``. Fresh: zeros.
- every attention layer's ``q_range``/``k_range``/``v_range`` (``set_default_quant_scales``): read only by
  ``calc_kv_scales``, while the layer's ``calculate_kv_scales`` is set (an fp8 KV cache with computed scales; it is
  cleared after the first forward, which the engine's start runs). Fresh: vLLM's ``Q/K/V_SCALE_CONSTANT``.
- (vLLM >= 0.31) every attention layer's ``_k_scale_cpu``/``_v_scale_cpu``: the KV-cache scales for the backends that
  take them from a tensor (ROCm's AITER; never read on CUDA). Fresh: the layer's ``_k_scale_float``/``_v_scale_float``,
  which vLLM's own loaders copy into them (``kv_cache.py``, ``compressed_tensors.py``).

Everything is rewritten in place (``fill_``): CUDA graphs captured on these tensors keep their addresses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

# attribute -> vLLM's environment constant a fresh attention layer holds (vllm/envs.py)
_KV_SCALE_RANGES = {"q_range": "Q_SCALE_CONSTANT", "k_range": "K_SCALE_CONSTANT", "v_range": "V_SCALE_CONSTANT"}
# attribute -> the Python float of the same layer that vLLM keeps equal to it (a float survives any sleep)
_KV_SCALE_MIRRORS = {"_k_scale_cpu": "_k_scale_float", "_v_scale_cpu": "_v_scale_float"}


@dataclass(frozen=True)
class PlainTensor:
    """One tensor a forward reads that is neither a parameter nor a buffer, and every value a fresh engine has in it."""

    name: str
    tensor: torch.Tensor
    fresh: float


def served_model(engine: Any) -> Any:
    """The model of a colocated engine, where TRL's own push reaches it (``driver_worker.model_runner``): unwrapped
    from vLLM's CUDA-graph wrapper (``get_model``); None where it is not in this process or not a torch module."""
    runner: Any = engine
    for attribute in ("llm_engine", "model_executor", "driver_worker", "model_runner"):
        runner = getattr(runner, attribute, None)
    get_model = getattr(runner, "get_model", None)
    model = get_model() if callable(get_model) else getattr(runner, "model", None)
    return model if isinstance(model, torch.nn.Module) else None


def read_by_forward(model: torch.nn.Module) -> list[PlainTensor]:
    """The plain tensors of ``model`` that a forward reads (the kinds of this module's docstring)."""
    return list(_deepstack(model)) + list(_kv_scale_ranges(model)) + list(_kv_scale_mirrors(model))


def _deepstack(model: torch.nn.Module) -> Iterator[PlainTensor]:
    for prefix, module in model.named_modules():
        embeds = vars(module).get("deepstack_input_embeds")
        if isinstance(embeds, (list, tuple)):
            for index, tensor in enumerate(embeds):
                if isinstance(tensor, torch.Tensor):
                    yield PlainTensor(_joined(prefix, f"deepstack_input_embeds[{index}]"), tensor, 0.0)


def _kv_scale_ranges(model: torch.nn.Module) -> Iterator[PlainTensor]:
    for prefix, module in model.named_modules():
        if vars(module).get("calculate_kv_scales") is not True:
            continue
        from vllm import envs

        for attribute, constant in _KV_SCALE_RANGES.items():
            tensor = vars(module).get(attribute)
            if isinstance(tensor, torch.Tensor):
                yield PlainTensor(_joined(prefix, attribute), tensor, float(getattr(envs, constant)))


def _kv_scale_mirrors(model: torch.nn.Module) -> Iterator[PlainTensor]:
    for prefix, module in model.named_modules():
        for attribute, mirror in _KV_SCALE_MIRRORS.items():
            tensor, value = vars(module).get(attribute), vars(module).get(mirror)
            if isinstance(tensor, torch.Tensor) and isinstance(value, (int, float)):
                yield PlainTensor(_joined(prefix, attribute), tensor, float(value))


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def reset(tensors: list[PlainTensor]) -> None:
    """Every tensor back to what a fresh engine holds, in place."""
    with torch.no_grad():
        for plain in tensors:
            plain.tensor.fill_(plain.fresh)
