"""Tiny random Qwen vision-language models and processors, built offline (tests, example, self-test).

Nothing is downloaded: a byte-level vocabulary with the Qwen special tokens, a 2-layer text model and a 1-block vision
tower. ``qwen3_5`` (the default) has one Gated-DeltaNet linear-attention layer and one full-attention layer;
``qwen3_vl`` and ``qwen2_5_vl`` are the other Qwen VLM families whose processors return ``mm_token_type_ids``
(Qwen3-VL, dense and MoE, with deepstack as released: a 2-block vision tower whose both blocks feed the two text
layers, ``DEEPSTACK_VISUAL_INDEXES``);
``qwen3_5_moe`` and ``qwen3_vl_moe`` their mixture-of-experts siblings (4 experts, 2 per token; Qwen3.5 MoE with a
shared expert), with transformers 5's fused expert tensors (``experts.gate_up_proj``, ``experts.down_proj``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

PATCH_SIZE = 16
MERGE_SIZE = 2
# Qwen3-VL's deepstack, as every released checkpoint has it (3 levels from a 27-block tower at full size): here each
# of the 2 vision blocks feeds one of the 2 text layers, so every level reaches the text model (tests/test_every_tensor)
DEEPSTACK_VISUAL_INDEXES = [0, 1]
# the text stack of every tiny model here (VLM or text-only): small enough to train in seconds on a CPU
TINY_TEXT_SHAPE: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def _byte_level_vocab() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: index for index, char in enumerate(sorted(bytes_to_unicode().values()))}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab


class FamilyClasses(NamedTuple):
    """The transformers classes of one Qwen VLM family (looked up by name: transformers is imported lazily)."""

    processor: str
    video_processor: str
    config: str
    model: str


FAMILIES = {
    "qwen3_5": FamilyClasses(
        "Qwen3VLProcessor", "Qwen3VLVideoProcessor", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"
    ),
    "qwen3_vl": FamilyClasses(
        "Qwen3VLProcessor", "Qwen3VLVideoProcessor", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration"
    ),
    "qwen2_5_vl": FamilyClasses(
        "Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"
    ),
    # the mixture-of-experts siblings: the same processor, markers and rope index as their dense families
    "qwen3_5_moe": FamilyClasses(
        "Qwen3VLProcessor", "Qwen3VLVideoProcessor", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"
    ),
    "qwen3_vl_moe": FamilyClasses(
        "Qwen3VLProcessor", "Qwen3VLVideoProcessor", "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"
    ),
}
# a few small experts: every expert tensor, the router and (Qwen3.5 MoE) the shared expert exist, as at full size
TINY_MOE_SHAPE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


def build_processor(family: str = "qwen3_5") -> Any:
    """A working processor of ``family`` over the tiny vocabulary (default padding side, as a user would load it)."""
    import transformers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    tokenizer = Qwen3_5Tokenizer(
        vocab=_byte_level_vocab(), merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    patch = _patch_size(family)
    pixels = {"shortest_edge": 2 * patch * 2 * patch, "longest_edge": 128 * 128}
    shape = {"patch_size": patch, "merge_size": MERGE_SIZE, "temporal_patch_size": 2, "size": pixels}
    classes = FAMILIES[family]
    processor_class = getattr(transformers, classes.processor)
    video_class = getattr(transformers, classes.video_processor)
    return processor_class(
        image_processor=transformers.Qwen2VLImageProcessorPil(**shape),
        tokenizer=tokenizer,
        video_processor=video_class(**shape),
        chat_template=CHAT_TEMPLATE,
    )


def _patch_size(family: str) -> int:
    return 14 if family == "qwen2_5_vl" else PATCH_SIZE


def qwen35_layer_stack(layers: int, heads: int, head_dim: int, value_heads: int) -> dict[str, Any]:
    """Qwen3.5's text stack as released at any size: three Gated-DeltaNet layers to one full-attention layer, with
    the head dims vLLM's kernels accept (for the benchmarks' realistic shapes)."""
    return {
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": heads,
        "linear_num_value_heads": value_heads,
    }


def build_config(
    vocab_size: int,
    token_ids: dict[str, int],
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    family: str = "qwen3_5",
) -> Any:
    """The tiny test shape; ``text``/``vision`` override fields (the GPU benchmarks: larger, kernel-ready)."""
    import transformers

    text_config: dict[str, Any] = {
        "vocab_size": vocab_size,
        **TINY_TEXT_SHAPE,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        "pad_token_id": token_ids["<|endoftext|>"],
        "eos_token_id": token_ids["<|im_end|>"],
    }
    vision_config: dict[str, Any] = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": _patch_size(family),
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
        "out_hidden_size": 32,
    }
    if family in ("qwen3_5", "qwen3_5_moe"):
        text_config.update(
            layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
        )
        vision_config["num_position_embeddings"] = 64
    elif family in ("qwen3_vl", "qwen3_vl_moe"):
        text_config["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        }
        vision_config.update(
            num_position_embeddings=64,
            depth=len(DEEPSTACK_VISUAL_INDEXES),
            deepstack_visual_indexes=list(DEEPSTACK_VISUAL_INDEXES),
        )
    else:  # qwen2_5_vl: head_dim is hidden / heads, no interleaving
        text_config.pop("head_dim")
        text_config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        text_config["bos_token_id"] = token_ids["<|endoftext|>"]
        vision_config.update(window_size=112, fullatt_block_indexes=[0])
    if family.endswith("_moe"):
        text_config.update(TINY_MOE_SHAPE)
        if family == "qwen3_5_moe":
            text_config["shared_expert_intermediate_size"] = 16
    return getattr(transformers, FAMILIES[family].config)(
        text_config={**text_config, **(text or {})},
        vision_config={**vision_config, **(vision or {})},
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def build_tiny_qwen3_text(directory: str | Path, seed: int = 0) -> Path:
    """A tiny random Qwen3 text model (no Gated-DeltaNet layers, no vision): what the engine fixes leave alone."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    tokenizer = build_processor().tokenizer
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        **TINY_TEXT_SHAPE,
        pad_token_id=token_ids["<|endoftext|>"],
        eos_token_id=token_ids["<|im_end|>"],
        bos_token_id=token_ids["<|endoftext|>"],
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def sized_text(layers: int, hidden: int, family: str = "qwen3_5") -> dict[str, Any]:
    """A text config of ``layers`` decoder layers of width ``hidden`` for ``build_tiny_qwen35_vlm`` (the benchmarks'
    sizes): head_dim 16, the tiny checkpoints' M-RoPE sections; Qwen3.5's families three Gated-DeltaNet layers to one
    full-attention layer, as released."""
    text: dict[str, Any] = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": max(1, hidden // 16),
        "num_key_value_heads": 1,
    }
    if family.startswith("qwen3_5"):
        text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return text


def build_tiny_qwen35_vlm(
    directory: str | Path,
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    dtype: str = "float32",
    family: str = "qwen3_5",
    sharpness: float = 1.0,
    placeholder_scale: float = 1.0,
) -> Path:
    """Write a random VLM checkpoint of ``family`` (tiny unless ``text``/``vision`` say otherwise) and its processor.

    The output layer's rows can be rescaled: every token's by ``sharpness`` (20: logits of std ~2, a peaked
    distribution where top-p and min-p cut, as a trained model's), then the vision placeholders' by
    ``placeholder_scale`` (0 at sharpness 20: about 1e-3 of the mass per token on them, a realistic policy; 50 at
    sharpness 1: about half of it, a policy that loves them)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    directory = Path(directory)
    processor = build_processor(family)
    tokenizer = processor.tokenizer
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    torch.manual_seed(seed)
    config = build_config(len(tokenizer), token_ids, text, vision, family)
    model = getattr(transformers, FAMILIES[family].model)(config).to(getattr(torch, dtype))
    if sharpness != 1.0 or placeholder_scale != 1.0:
        placeholders = [token_ids[token] for token in SPECIAL_TOKENS[3:]]
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head.mul_(sharpness)
            head[placeholders] *= placeholder_scale / sharpness if sharpness else 0.0
    model.generation_config = GenerationConfig(
        eos_token_id=token_ids["<|im_end|>"], pad_token_id=token_ids["<|endoftext|>"]
    )
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
