"""mm_realign: rebuild Qwen's ``mm_token_type_ids`` from the ``input_ids`` that actually reach the model.

TRL 1.9.1 left-pads ``prompt_ids`` but takes ``mm_token_type_ids`` from a second processor call that pads on the
processor's side (right for Qwen). In a batch of unequal prompt lengths the markers then point at the wrong columns:
``get_rope_index`` crashes with ``shape mismatch`` or silently assigns wrong vision positions. The wrapper sits on
``_get_per_token_logps_and_entropies``, the one place every scoring pass (old, ref and policy log-probs) goes
through, so the markers are aligned by construction wherever they are used.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

from .. import metrics
from ..registry import Fix, Target

LOGGER = logging.getLogger("trl_vlm_fixes")

_TARGET_METHOD = "_get_per_token_logps_and_entropies"
_REQUIRED = ("input_ids", "mm_token_type_ids", "image_grid_thw", "num_images")

_pad_ids_cache: weakref.WeakKeyDictionary[Any, tuple[int | None, int | None, int]] = weakref.WeakKeyDictionary()
_signature_cache: dict[Any, inspect.Signature] = {}


def _unwrap_model(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _token_id(tokenizer: Any, token: str) -> int | None:
    if tokenizer is None or not hasattr(tokenizer, "convert_tokens_to_ids"):
        return None
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return int(token_id)


def resolve_vision_ids(trainer: Any, model: Any) -> tuple[int | None, int | None, int]:
    """(image pad id, video pad id, spatial merge size): trainer first, then processor, then model config."""
    cached = _pad_ids_cache.get(trainer)
    if cached is not None:
        return cached
    processor = getattr(trainer, "processing_class", None)
    tokenizer = getattr(processor, "tokenizer", processor)
    config = getattr(_unwrap_model(model), "config", None)

    def first(*candidates: Any) -> int | None:
        for candidate in candidates:
            if isinstance(candidate, int):
                return candidate
        return None

    image_id = first(
        getattr(trainer, "_image_pad_token_id", None),
        getattr(processor, "image_token_id", None),
        _token_id(tokenizer, "<|image_pad|>"),
        getattr(config, "image_token_id", None),
    )
    video_id = first(
        getattr(trainer, "_video_pad_token_id", None),
        getattr(processor, "video_token_id", None),
        _token_id(tokenizer, "<|video_pad|>"),
        getattr(config, "video_token_id", None),
    )
    merge_size = first(
        getattr(getattr(processor, "image_processor", None), "merge_size", None),
        getattr(getattr(config, "vision_config", None), "spatial_merge_size", None),
    )
    resolved = (image_id, video_id, merge_size or 2)
    with contextlib.suppress(TypeError):  # a trainer that cannot be weakly referenced is simply not cached
        _pad_ids_cache[trainer] = resolved
    if image_id is None and video_id is None:
        LOGGER.warning(
            "trl_vlm_fixes.mm_realign: no image or video pad token id is known for %s (trainer, processor and model "
            "config give none); mm_token_type_ids are left as TRL built them.",
            type(trainer).__name__,
        )
    return resolved


def _bind(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    function = getattr(wrapped, "__func__", wrapped)
    signature = _signature_cache.get(function)
    if signature is None:
        signature = inspect.signature(wrapped)
        _signature_cache[function] = signature
    return signature.bind(*args, **kwargs)


def realign_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = _bind(wrapped, args, kwargs)
    markers = bound.arguments.get("mm_token_type_ids")
    input_ids = bound.arguments.get("input_ids")
    if markers is None or input_ids is None:
        return wrapped(*args, **kwargs)
    image_id, video_id, merge_size = resolve_vision_ids(instance, bound.arguments.get("model"))
    if image_id is None and video_id is None:
        return wrapped(*args, **kwargs)
    from ..realign import VisionCountCheck, changed_rows, rebuild_mm_token_type_ids  # torch: only once TRL runs

    realigned = rebuild_mm_token_type_ids(input_ids, image_id, video_id, dtype=markers.dtype)
    metrics.count(instance, metrics.REALIGNED_ROWS, changed_rows(markers, realigned))
    bound.arguments["mm_token_type_ids"] = realigned
    grid = bound.arguments.get("image_grid_thw")
    check = None
    if grid is not None and bound.arguments.get("pixel_values") is not None:
        check = VisionCountCheck(realigned, grid, bound.arguments.get("num_images"), merge_size)
    try:
        result = wrapped(*bound.args, **bound.kwargs)
    except Exception as error:
        if check is not None:
            check.raise_if_mismatched_from(error)
        raise
    if check is not None:
        check.raise_if_mismatched()
    return result


def _targets() -> tuple[Target, ...]:
    return tuple(
        Target(
            module=module,
            qualname=f"{cls}.{_TARGET_METHOD}",
            wrapper=realign_wrapper,
            required_parameters=_REQUIRED,
        )
        for module, cls in (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))
    )


FIX = Fix(
    name="mm_realign",
    summary="rebuild mm_token_type_ids from the input_ids the model sees (mixed image batches)",
    packages=("trl",),
    targets=_targets(),
)
