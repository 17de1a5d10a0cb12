"""mm_realign: rebuild Qwen's ``mm_token_type_ids`` from the ``input_ids`` that actually reach the model.

TRL 1.9.1 left-pads ``prompt_ids`` but takes ``mm_token_type_ids`` from a second processor call that pads on the
processor's side (right for Qwen, when the user passes their own processor; TRL's own default processor is loaded
left-padded). In a batch of unequal prompt lengths the markers then point at the wrong columns: ``get_rope_index``
crashes with ``shape mismatch`` or silently assigns wrong vision positions. The wrapper sits on
``_get_per_token_logps_and_entropies``, the one place every scoring pass (old, ref and policy log-probs) goes
through, so the markers are aligned by construction wherever they are used.

It acts for the models whose markers it is proven to rebuild exactly (image pad -> 1, video pad -> 2, else 0, with
distinct image and video pad tokens): those whose ``get_rope_index`` is Qwen3.5's (shared line for line by Qwen3.5
MoE, Qwen3-VL and Qwen3-VL MoE) or Qwen2.5-VL's (``vision_tokens.markers_problem``). Any other model (other marker
values, such as Gemma 4's audio 3, or one placeholder shared by images and videos, such as GLM-4V) keeps TRL's markers,
and one log line says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ... import metrics
from ...call_arguments import bind
from ...declaration import Applicability, Counter, Fix, Plan, on_trainers
from ...log_once import warn_once
from ...logs import fix_logger
from ...model_facts import markers_problem as config_markers_problem
from ...model_facts import shares_one_placeholder
from ...owner_state import OwnerState
from ...vision_tokens import VisionTokens, markers_problem, model_type, vision_tokens

LOGGER = fix_logger(__name__)

_TARGET_METHOD = "_get_per_token_logps_and_entropies"
_REQUIRED = ("input_ids", "mm_token_type_ids", "image_grid_thw", "num_images", "logits_to_keep")
REALIGNED_ROWS = Counter("trl_vlm_fixes/mm_realigned_rows")
_resolved: OwnerState[VisionTokens] = OwnerState(lambda: VisionTokens(None, None))


def resolve_vision_ids(trainer: Any, model: Any) -> VisionTokens:
    """The trainer's vision token ids (``vision_tokens``: the processor's own first); only a found id is cached."""
    cached = _resolved.get(trainer)
    if cached is not None:
        return cached
    found = vision_tokens(getattr(trainer, "processing_class", None), model, trainer)
    if found.image is None and found.video is None:
        LOGGER.warning(
            "no image or video pad token id is known for %s (processor, trainer, tokenizer and model config give "
            "none); mm_token_type_ids are left as TRL built them.",
            type(trainer).__name__,
        )
        return found
    _resolved.set(trainer, found)
    return found


def _steps_aside(model: Any, tokens: VisionTokens) -> str | None:
    """Why the markers of this model cannot be rebuilt exactly, or None."""
    if problem := markers_problem(model):
        return problem
    if tokens.image is not None and tokens.image == tokens.video:
        return "images and videos share one placeholder token, so the markers cannot be told apart"
    return None


def scope(trainer: Any) -> str | None:
    """Where this trainer's model keeps TRL's markers (see ``_steps_aside``)."""
    model = getattr(trainer, "model", None)
    return _steps_aside(model, vision_tokens(getattr(trainer, "processing_class", None), model, trainer))


def config_markers(plan: Plan) -> str | None:
    """``scope`` before the trainer exists (every mode): the model type's ``get_rope_index`` and placeholders, from
    its config."""
    if problem := config_markers_problem(plan.config):
        return problem
    if shares_one_placeholder(plan.config):
        return "images and videos share one placeholder token, so the markers cannot be told apart"
    return None


def realign_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = bind(wrapped, args, kwargs)
    markers = bound.arguments.get("mm_token_type_ids")
    input_ids = bound.arguments.get("input_ids")
    if markers is None or input_ids is None:
        return wrapped(*args, **kwargs)
    model = bound.arguments.get("model")
    tokens = resolve_vision_ids(instance, model)
    if tokens.image is None and tokens.video is None:
        return wrapped(*args, **kwargs)
    reason = _steps_aside(model, tokens)
    if reason:
        warn_once(
            ("mm_realign steps aside", type(instance).__name__, model_type(model)),
            "steps aside for %s: %s; mm_token_type_ids are left as TRL built them.",
            type(instance).__name__,
            reason,
            logger=LOGGER,
        )
        return wrapped(*args, **kwargs)
    from .realign import VisionCountCheck, changed_rows, realign_prompt_markers  # torch: only once TRL runs

    prompt_columns = input_ids.size(1) - int(bound.arguments.get("logits_to_keep") or 0)
    realigned = realign_prompt_markers(input_ids, markers, prompt_columns, tokens.image, tokens.video)
    metrics.count(instance, REALIGNED_ROWS, changed_rows(markers, realigned))
    bound.arguments["mm_token_type_ids"] = realigned
    grid = bound.arguments.get("image_grid_thw")
    check = None
    if grid is not None and bound.arguments.get("pixel_values") is not None:
        check = VisionCountCheck(realigned, grid, bound.arguments.get("num_images"), tokens.merge)
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
    summary="rebuild mm_token_type_ids from the input_ids the model sees (Qwen3.5, Qwen3-VL, Qwen2.5-VL; also MoE)",
    packages=("trl",),
    targets=on_trainers({_TARGET_METHOD: realign_wrapper}, required_parameters=_REQUIRED),
    counters=(REALIGNED_ROWS,),
    selftest="trl_vlm_fixes.selftest.checks.mm_realign:check",
    scope=scope,
    applicability=Applicability(checkpoint=config_markers),
)
