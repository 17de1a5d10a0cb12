"""vLLM's own multimodal processor on the CPU: the prompt ids a real engine would sample from.

vLLM 0.25.1 builds its processor for a checkpoint without any GPU (``MULTIMODAL_REGISTRY.create_processor`` on a
``ModelConfig``), and ``apply`` runs exactly the prompt processing of the engine's input processor: for a token prompt
it applies the prompt update (one ``<|image_pad|>`` becomes the image's N pads). The engine stand-in calls it so that
the CPU tests see what vLLM really does to the prompts TRL sends. Needs vLLM plus ``einops``, ``loguru``, ``blake3``
and ``compressed-tensors`` (installed by ``scripts/setup_env.sh``); about 10-20 s to build once per process.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_processors: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()


class VllmProcessorUnavailable(RuntimeError):
    """vLLM's multimodal processor cannot be built here (vLLM or one of its light dependencies is missing)."""


def processor_for(model_dir: str, mm_processor_kwargs: Mapping[str, Any] | None = None) -> Any:
    """vLLM's multimodal processor of ``model_dir`` as an engine built with these ``mm_processor_kwargs`` has it."""
    key = (str(model_dir), json.dumps(dict(mm_processor_kwargs or {}), sort_keys=True))
    with _lock:
        if key not in _processors:
            try:
                from vllm.config import ModelConfig
                from vllm.multimodal import MULTIMODAL_REGISTRY
            except Exception as error:  # any import failure means the same here: no processor
                raise VllmProcessorUnavailable(
                    f"vLLM's multimodal processor cannot be imported ({error!r}); install vllm==0.25.1 and "
                    "`pip install einops loguru blake3` plus `pip install --no-deps compressed-tensors==0.17.0` "
                    "(scripts/setup_env.sh does)"
                ) from error
            with transformers_config_classes_kept():
                config = ModelConfig(
                    model=str(model_dir),
                    tokenizer=str(model_dir),
                    dtype="float32",
                    mm_processor_kwargs=dict(mm_processor_kwargs) if mm_processor_kwargs else None,
                )
                _processors[key] = MULTIMODAL_REGISTRY.create_processor(config)
        return _processors[key]


@contextmanager
def transformers_config_classes_kept() -> Iterator[None]:
    """Building a ModelConfig registers vLLM's own config classes with transformers' AutoConfig (``qwen3_5`` among
    them, ``vllm/transformers_utils/config.py``); a later ``from_pretrained`` of a tiny Qwen3.5 then gets vLLM's
    vision config, which lacks ``num_attention_heads``. A real colocated engine leaves that registration behind too,
    after TRL has loaded its models; the stand-in puts transformers' registry back so later tests load as usual."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    saved = dict(CONFIG_MAPPING._extra_content)
    try:
        yield
    finally:
        CONFIG_MAPPING._extra_content.clear()
        CONFIG_MAPPING._extra_content.update(saved)


def engine_prompt_ids(
    model_dir: str,
    prompt_token_ids: list[int],
    multi_modal_data: Mapping[str, Any],
    mm_processor_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The prompt ids vLLM samples from for ``{"prompt_token_ids": ..., "multi_modal_data": ...}``."""
    from vllm.multimodal.processing import ProcessorInputs, TimingContext

    processor = processor_for(model_dir, mm_processor_kwargs)
    inputs = ProcessorInputs(
        prompt=list(prompt_token_ids), mm_data_items=processor.info.parse_mm_data(dict(multi_modal_data))
    )
    return list(processor.apply(inputs, TimingContext())["prompt_token_ids"])
