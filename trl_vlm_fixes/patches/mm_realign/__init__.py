"""mm_realign: rebuild Qwen's ``mm_token_type_ids`` from the ``input_ids`` that actually reach the model.

TRL 1.9.1 left-pads ``prompt_ids`` but takes ``mm_token_type_ids`` from a second processor call that pads on the
processor's side (right for Qwen, when the user passes their own processor; TRL's own default processor is loaded
left-padded). In a batch of unequal prompt lengths the markers then point at the wrong columns: ``get_rope_index``
crashes with ``shape mismatch`` or silently assigns wrong vision positions. The wrapper sits on
``_get_per_token_logps_and_entropies``, the one place every scoring pass (old, ref and policy log-probs) goes
through, so the markers are aligned by construction wherever they are used.

It acts only for the model families whose markers it is proven to rebuild exactly (image pad -> 1, video pad -> 2,
else 0, with distinct image and video pad tokens): Qwen3.5, Qwen3-VL and Qwen2.5-VL. Any other family (other marker
values, such as Gemma 4's audio 3, or one placeholder shared by images and videos, such as GLM-4V) keeps TRL's markers,
and one log line says so.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

from ... import metrics
from ...call_arguments import bind
from ...log_once import warn_once
from ...registry import Fix, on_trainers

LOGGER = logging.getLogger("trl_vlm_fixes")

_TARGET_METHOD = "_get_per_token_logps_and_entropies"
_REQUIRED = ("input_ids", "mm_token_type_ids", "image_grid_thw", "num_images", "logits_to_keep")
# model_type of the families whose markers are rebuilt exactly (each proven by a test: crash or misscore upstream,
# exact per-row scores with the fix)
PROVEN_FAMILIES = frozenset({"qwen3_5", "qwen3_vl", "qwen2_5_vl"})

_pad_ids_cache: weakref.WeakKeyDictionary[Any, tuple[int | None, int | None, int]] = weakref.WeakKeyDictionary()


def _unwrap_model(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def model_family(model: Any) -> str | None:
    return getattr(getattr(_unwrap_model(model), "config", None), "model_type", None)


def _token_id(tokenizer: Any, token: str) -> int | None:
    if tokenizer is None or not hasattr(tokenizer, "convert_tokens_to_ids"):
        return None
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return int(token_id)


def _first_int(*candidates: Any) -> int | None:
    return next((int(c) for c in candidates if isinstance(c, int) and not isinstance(c, bool)), None)


def resolve_vision_ids(trainer: Any, model: Any) -> tuple[int | None, int | None, int]:
    """(image pad id, video pad id, spatial merge size).

    The processor's own ``image_token_id`` / ``video_token_id`` are authoritative; then TRL's guess (the trainer's
    ``_image_pad_token_id``), the tokenizer's Qwen tokens, the model config. Only a successful resolution is cached.
    """
    with contextlib.suppress(TypeError):  # a trainer that cannot be weakly referenced is never cached
        cached = _pad_ids_cache.get(trainer)
        if cached is not None:
            return cached
    processor = getattr(trainer, "processing_class", None)
    tokenizer = getattr(processor, "tokenizer", processor)
    config = getattr(_unwrap_model(model), "config", None)
    image_id = _first_int(
        getattr(processor, "image_token_id", None),
        getattr(trainer, "_image_pad_token_id", None),
        _token_id(tokenizer, "<|image_pad|>"),
        getattr(config, "image_token_id", None),
    )
    video_id = _first_int(
        getattr(processor, "video_token_id", None),
        getattr(trainer, "_video_pad_token_id", None),
        _token_id(tokenizer, "<|video_pad|>"),
        getattr(config, "video_token_id", None),
    )
    merge_size = _first_int(
        getattr(getattr(processor, "image_processor", None), "merge_size", None),
        getattr(getattr(config, "vision_config", None), "spatial_merge_size", None),
    )
    resolved = (image_id, video_id, merge_size or 2)
    if image_id is None and video_id is None:
        LOGGER.warning(
            "trl_vlm_fixes.mm_realign: no image or video pad token id is known for %s (processor, trainer, tokenizer "
            "and model config give none); mm_token_type_ids are left as TRL built them.",
            type(trainer).__name__,
        )
        return resolved
    with contextlib.suppress(TypeError):  # a trainer that cannot be weakly referenced is simply not cached
        _pad_ids_cache[trainer] = resolved
    return resolved


def _steps_aside(family: str | None, image_id: int | None, video_id: int | None) -> str | None:
    """Why the markers of this model cannot be rebuilt exactly, or None."""
    if family not in PROVEN_FAMILIES:
        proven = ", ".join(sorted(PROVEN_FAMILIES))
        return f"model type {family!r} is not one whose markers it rebuilds exactly ({proven})"
    if image_id is not None and image_id == video_id:
        return "images and videos share one placeholder token, so the markers cannot be told apart"
    return None


def realign_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = bind(wrapped, args, kwargs)
    markers = bound.arguments.get("mm_token_type_ids")
    input_ids = bound.arguments.get("input_ids")
    if markers is None or input_ids is None:
        return wrapped(*args, **kwargs)
    model = bound.arguments.get("model")
    image_id, video_id, merge_size = resolve_vision_ids(instance, model)
    if image_id is None and video_id is None:
        return wrapped(*args, **kwargs)
    family = model_family(model)
    reason = _steps_aside(family, image_id, video_id)
    if reason:
        warn_once(
            ("mm_realign steps aside", type(instance).__name__, family),
            "trl_vlm_fixes.mm_realign steps aside for %s: %s; mm_token_type_ids are left as TRL built them.",
            type(instance).__name__,
            reason,
        )
        return wrapped(*args, **kwargs)
    from .realign import VisionCountCheck, changed_rows, realign_prompt_markers  # torch: only once TRL runs

    prompt_columns = input_ids.size(1) - int(bound.arguments.get("logits_to_keep") or 0)
    realigned = realign_prompt_markers(input_ids, markers, prompt_columns, image_id, video_id)
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


FIX = Fix(
    name="mm_realign",
    summary="rebuild mm_token_type_ids from the input_ids the model sees (Qwen3.5, Qwen3-VL, Qwen2.5-VL)",
    packages=("trl",),
    targets=on_trainers({_TARGET_METHOD: realign_wrapper}, required_parameters=_REQUIRED),
)
