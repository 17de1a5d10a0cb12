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
    import torch
    from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from trl_vlm_fixes.tiny_model import SPECIAL_TOKENS, build_processor

    processor = build_processor()
    tokenizer = processor.tokenizer
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    heads = max(2, hidden // 128)
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": heads,
        "linear_num_value_heads": heads * 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    vision = {
        "depth": 1,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden,
        "num_position_embeddings": 64,
    }
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


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
