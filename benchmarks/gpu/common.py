"""Shared set-up for the GPU benchmarks: a random Qwen3.5 VLM built offline, and vLLM 0.25.1 quirks on Hopper."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def prepare_single_process_colocate() -> None:
    """TRL's colocate mode runs vLLM in-process (external_launcher): it needs the torch.distributed variables."""
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": os.environ.get("MASTER_PORT", "29555"),
    }.items():
        os.environ.setdefault(key, value)


def force_triton_gdn_prefill() -> None:
    """FlashInfer is absent from the offline bundles: vLLM 0.25.1 would pick it for the Gated-DeltaNet prefill."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    qwen_gdn_linear_attn._resolve_gdn_prefill_backend = lambda *args, **kwargs: ("triton", "triton")


def build_random_qwen35(directory: str | Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random Qwen3.5 VLM with the real 3:1 linear/full attention layout, head dims vLLM's kernels accept."""
    from trl_vlm_fixes.tiny_model import build_tiny_qwen35_vlm

    heads = max(2, hidden // 128)
    text = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": heads,
        "linear_num_value_heads": heads * 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    }
    vision = {"hidden_size": 128, "intermediate_size": 256, "out_hidden_size": hidden}
    return build_tiny_qwen35_vlm(directory, seed, text=text, vision=vision, dtype="bfloat16")


def versions() -> dict[str, Any]:
    import torch
    import transformers
    import trl
    import vllm

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "vllm": vllm.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }
