"""prompt_parity: the rollout engine samples from the prompt the trainer scores.

TRL tokenizes a VLM prompt with its processor (``apply_chat_template(..., tokenize=True)``), so each image is already
expanded into its N ``<|image_pad|>`` tokens, and ``VLLMGeneration.generate`` hands vLLM those ids with the images:
``{"prompt_token_ids": ids, "multi_modal_data": {"image": ...}}`` in colocate mode, and the same ids and images through
``VLLMClient.generate`` to ``trl vllm-serve``, which builds the same request (TRL 1.9.1). vLLM 0.25.1 treats a token
prompt as not yet expanded and applies its prompt update again: the first pad of each run becomes N pads and the other
N-1 stay, so the engine samples from 2N-1 image tokens per image while the trainer scores the same completions with N
(vllm-project/vllm PR 57796; huggingface/trl 6294, 6401). No error, no warning.

The fix wraps ``VLLMGeneration.generate``, the one door of every TRL trainer (and of a ``rollout_func``) to vLLM:

- **collapse**: what goes to vLLM holds each image's run of pads as the single pad vLLM's processor expands (the
  images of the prompt, several per prompt, and those a tool returned in TRL's tool loop). The trainer keeps its own
  ids for scoring. Only the Qwen families whose expansion this is proven on (Qwen3.5, Qwen3-VL, Qwen2.5-VL, dense and
  MoE: one ``<|image_pad|>`` per image, expanded by vLLM to the same N the trainer's processor wrote; decided from
  what they share, ``vision_tokens.markers_problem``) are rewritten; TRL sends
  vLLM images only (no videos), so video pads are never touched.
- **parity check**: the prompt ids vLLM reports (``RequestOutput.prompt_token_ids``, which TRL discards) must equal
  the trainer's, row for row, for every family and mode. A row that differs (the engine's processor resized an image
  differently, a processor setting the engine never got, an upstream change) is counted in
  ``trl_vlm_fixes/prompt_mismatch_rows`` and logged once with the row, both lengths and the likely cause. The check
  compares Python lists the engine already returned: no tensor, no device synchronization.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from .. import metrics
from ..call_arguments import bind
from ..declaration import VLLM_MODES, Applicability, Counter, Fix, Plan, Target
from ..log_once import warn_once
from ..logs import fix_logger
from ..model_facts import markers_problem as config_markers_problem
from ..source_shape import calls_method, function_tree, string_constants
from ..vision_tokens import markers_problem, vision_tokens

LOGGER = fix_logger(__name__)
PROMPT_MISMATCH_ROWS = Counter("trl_vlm_fixes/prompt_mismatch_rows")

_MODULE = "trl.generation.vllm_generation"


# --- what this TRL sends vLLM (read from its source) -----------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _modes_sending_expanded_ids(code: Any, function: Callable[..., Any]) -> frozenset[str]:
    """The modes in which ``generate`` hands vLLM the caller's token ids together with raw images.

    colocate: it builds ``{"prompt_token_ids": ..., "multi_modal_data": ...}`` rows for ``LLM.generate``.
    server: it calls ``vllm_client.generate(..., images=...)`` (TRL 1.9.1; ``trl vllm-serve`` builds the same rows).
    Newer servers that receive processed image features with the expanded ids place them themselves (TRL >= 1.11's
    ``features=``), so that mode is not one of them.
    """
    tree = function_tree(function)
    if tree is None:
        return frozenset()
    modes = set()
    if {"prompt_token_ids", "multi_modal_data"} <= string_constants(tree):
        modes.add("colocate")
    if calls_method(tree, "generate", keyword="images"):
        modes.add("server")
    return frozenset(modes)


def modes_sending_expanded_ids(function: Callable[..., Any]) -> frozenset[str]:
    unwrapped = getattr(function, "__wrapped__", function)
    unwrapped = getattr(unwrapped, "__func__", unwrapped)
    return _modes_sending_expanded_ids(getattr(unwrapped, "__code__", None), unwrapped)


def _shape_problem(function: Callable[..., Any]) -> str | None:
    if function_tree(function) is None:
        return "source unavailable, cannot tell what VLLMGeneration.generate sends vLLM"
    return None


def _upstream_sends_unexpanded(function: Callable[..., Any]) -> str | None:
    if modes_sending_expanded_ids(function):
        return None
    return "this TRL sends vLLM no processor-expanded token prompt together with raw images"


# --- the prompt rewrite ----------------------------------------------------------------------------------------


def pad_runs(ids: list[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, end) of every run of ``pad_id`` in ``ids``, found with C-speed list operations (``index``, slice
    ``count``: a run's end by doubling then halving), not a Python loop over each of an image's hundreds of pads."""
    runs: list[tuple[int, int]] = []
    start, n = 0, len(ids)
    while True:
        try:
            first = ids.index(pad_id, start)
        except ValueError:
            return runs
        known, size = 1, 2  # ids[first:first + known] is all pads; is ids[first:first + size]?
        while first + size <= n and ids[first : first + size].count(pad_id) == size:
            known, size = size, size * 2
        low, high = known, min(size, n - first + 1)  # the run's length is in [low, high)
        while high - low > 1:
            middle = (low + high) // 2
            if ids[first : first + middle].count(pad_id) == middle:
                low = middle
            else:
                high = middle
        runs.append((first, first + low))
        start = first + low


def collapse_runs(ids: list[int], pad_id: int) -> list[int]:
    """``ids`` with every run of ``pad_id`` reduced to one token (the form vLLM's processor expands)."""
    return _collapsed(ids, pad_runs(ids, pad_id))


def _collapsed(ids: list[int], runs: list[tuple[int, int]]) -> list[int]:
    collapsed: list[int] = []
    previous = 0
    for first, end in runs:
        collapsed += ids[previous : first + 1]
        previous = end
    return collapsed + ids[previous:]


def count_runs(ids: list[int], pad_id: int) -> int:
    return len(pad_runs(ids, pad_id))


def _images_in(row_images: Any) -> int:
    if row_images is None:
        return 0
    return len(row_images) if isinstance(row_images, list | tuple) else 1


def _image_pad_id(generation: Any) -> int | None:
    return vision_tokens(getattr(generation, "processing_class", None)).image


def _why_not_rewritten(generation: Any, function: Callable[..., Any], pad_id: int | None) -> str | None:
    """Why this call's prompts go to vLLM as TRL built them, or None where they are collapsed."""
    if problem := markers_problem(getattr(generation, "model", None)):
        return f"{problem} (its image expansion is not proven)"
    if pad_id is None:
        return "the processing class defines no image pad token"
    mode = getattr(generation, "mode", None)
    if mode not in modes_sending_expanded_ids(function):
        return f"in {mode} mode this TRL does not send vLLM the expanded ids with raw images"
    return None


def scope(trainer: Any) -> str | None:
    """Where the rewrite steps aside for this trainer (the parity check still runs on every generate)."""
    generation = getattr(trainer, "vllm_generation", None)
    if not getattr(trainer, "use_vllm", False) or generation is None:
        return "use_vllm is off: TRL sends vLLM no prompt"
    if problem := markers_problem(getattr(trainer, "model", None)):
        return f"{problem}; the parity check still runs"
    return None


def config_markers(plan: Plan) -> str | None:
    """``scope`` before the trainer exists, past the mode: the model type's ``get_rope_index`` from its config."""
    if problem := config_markers_problem(plan.config):
        return f"{problem}; the parity check still runs"
    return None


def unexpanded_prompts(
    prompts: list[list[int]], images: list[Any] | None, pad_id: int
) -> tuple[list[list[int]], list[int]]:
    """(what vLLM should receive, the rows left as they were because their pad runs do not match their images)."""
    sent, left = [], []
    for row, ids in enumerate(prompts):
        wanted = _images_in(images[row]) if images is not None and row < len(images) else 0
        if wanted == 0 or pad_id not in ids:
            sent.append(ids)
        elif len(runs := pad_runs(ids, pad_id)) == wanted:
            sent.append(_collapsed(ids, runs))
        else:
            sent.append(ids)
            left.append(row)
    return sent, left


# --- the parity check ------------------------------------------------------------------------------------------


def mismatched_rows(
    engine_prompt_ids: Sequence[Sequence[int]] | None,
    trainer_prompt_ids: list[list[int]],
    pad_id: int | None = None,
    expansion: Callable[[int], list[int] | None] | None = None,
) -> list[int]:
    """Rows whose prompt, as vLLM reports it, is not the trainer's (a missing report counts as a mismatch). A row the
    caller sent with one pad per image (a ``rollout_func`` that leaves the expansion to vLLM) matches when vLLM
    expanded each of those pads to the number of tokens the trainer's processor gives that image
    (``expansion(row)``)."""
    if engine_prompt_ids is None or len(engine_prompt_ids) != len(trainer_prompt_ids):
        return list(range(len(trainer_prompt_ids)))
    rows = []
    for row, (engine, trainer) in enumerate(zip(engine_prompt_ids, trainer_prompt_ids, strict=True)):
        engine = engine if isinstance(engine, list) else list(engine)
        if engine != trainer and not _expanded_by_vllm(engine, trainer, pad_id, row, expansion):
            rows.append(row)
    return rows


def _expanded_by_vllm(
    engine: list[int],
    trainer: list[int],
    pad_id: int | None,
    row: int,
    expansion: Callable[[int], list[int] | None] | None,
) -> bool:
    """The caller sent each image as one pad, and vLLM expanded exactly those to what each image takes."""
    if pad_id is None or expansion is None:
        return False
    runs = pad_runs(trainer, pad_id)
    if not runs or any(end - start != 1 for start, end in runs) or collapse_runs(engine, pad_id) != trainer:
        return False
    expected = expansion(row)  # read only here, for a row that differs: no image processing on the common path
    if expected is None or len(expected) != len(runs) or any(tokens == 1 for tokens in expected):
        return False  # an image of one token: the trainer's single pad is its full expansion, not a placeholder
    return [end - start for start, end in pad_runs(engine, pad_id)] == expected


def image_tokens(generation: Any, row_images: Any) -> list[int] | None:
    """How many image pads the trainer's processor gives each image of a row, or None where it cannot say."""
    processor = getattr(getattr(generation, "processing_class", None), "image_processor", None)
    if processor is None or not row_images:
        return None
    images = list(row_images) if isinstance(row_images, list | tuple) else [row_images]
    try:
        grid = processor(images=images, return_tensors="pt")["image_grid_thw"]
    except Exception:  # noqa: BLE001 - unknown: the row is then compared as it is
        return None
    merge = vision_tokens(getattr(generation, "processing_class", None)).merge
    return [int(tokens) for tokens in (grid.prod(dim=-1) // (merge * merge)).tolist()]


def likely_cause(
    engine_ids: Sequence[int],
    trainer_prompt_ids: list[list[int]],
    row: int,
    images: int,
    pad_id: int | None,
    rewritten: bool,
    server: bool = False,
) -> str:
    """Why row ``row`` of the engine's prompts is not the trainer's, from the two id lists alone."""
    trainer_ids = trainer_prompt_ids[row]
    engine = list(engine_ids)
    pairing = (
        "vLLM sampled this row from another row's prompt (TRL 1.9.1's server mode keeps one prompt per "
        "num_generations rows, the first of each group, possibly on another rank; its tool loop does so for rows "
        "with different histories too)"
    )
    if any(engine == other for i, other in enumerate(trainer_prompt_ids) if i != row):
        return pairing
    engine_pads = engine.count(pad_id) if pad_id is not None else 0
    trainer_pads = trainer_ids.count(pad_id) if pad_id is not None else 0
    runs = count_runs(trainer_ids, pad_id) if pad_id is not None else 0
    if images and runs != images:
        return f"the row holds {runs} image pad runs for {images} images, so it went to vLLM as TRL built it"
    same_text = pad_id is None or collapse_runs(engine, pad_id) == collapse_runs(trainer_ids, pad_id)
    if same_text and not rewritten and images and engine_pads == 2 * trainer_pads - images:
        return (
            "vLLM expanded the trainer's already expanded image placeholders a second time (prompt_parity is off or "
            "stepped aside for this model or mode)"
        )
    if same_text and engine_pads != trainer_pads:
        return (
            "vLLM's processor expanded the images to another number of tokens than the trainer's processor: they "
            "resize differently (TRL gives the engine no mm_processor_kwargs, so save the trainer's processor "
            "settings, e.g. min_pixels/max_pixels, with processor.save_pretrained into the model folder the engine "
            "loads)"
        )
    if server and not same_text:
        return pairing
    return "the engine tokenized or rewrote the text of the prompt differently (an upstream change)"


def _report(
    generation: Any,
    rows: list[int],
    engine_prompt_ids: Sequence[Sequence[int]] | None,
    trainer_prompt_ids: list[list[int]],
    images: list[Any] | None,
    sent: list[list[int]] | None,
) -> None:
    row = rows[0]
    trainer_ids = trainer_prompt_ids[row]
    if engine_prompt_ids is None or len(engine_prompt_ids) != len(trainer_prompt_ids):
        engine_ids: Sequence[int] = []
        cause = "the engine reported no prompt ids for these rows (an upstream change)"
    else:
        engine_ids = engine_prompt_ids[row]
        wanted = _images_in(images[row]) if images is not None and row < len(images) else 0
        rewritten = sent is not None and sent[row] is not trainer_ids
        server = getattr(generation, "mode", None) == "server"
        cause = likely_cause(engine_ids, trainer_prompt_ids, row, wanted, _image_pad_id(generation), rewritten, server)
    warn_once(
        ("prompt_parity mismatch", cause),
        "vLLM sampled %d of %d rows from another prompt than the trainer scores (first: "
        "row %d, vLLM %d tokens, trainer %d tokens); likely cause: %s. Counted in %s; logged once per cause.",
        len(rows),
        len(trainer_prompt_ids),
        row,
        len(engine_ids),
        len(trainer_ids),
        cause,
        PROMPT_MISMATCH_ROWS,
        logger=LOGGER,
    )


def _as_id_lists(prompts: Any) -> list[list[int]] | None:
    """The prompts as lists of ints (TRL's own are; a ``rollout_func`` may pass tuples or tensors), else None."""
    if not isinstance(prompts, list | tuple):
        return None
    rows = []
    for ids in prompts:
        if isinstance(ids, list):
            rows.append(ids)
        elif hasattr(ids, "tolist") or isinstance(ids, tuple):
            as_list = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            if not isinstance(as_list, list):
                return None
            rows.append(as_list)
        else:
            return None
    return rows


def _collapsed_for_vllm(instance: Any, wrapped: Callable[..., Any], prompts: list[list[int]], images: Any) -> Any:
    """The prompts to send vLLM, or None where they go as TRL built them (with one log line saying why)."""
    pad_id = _image_pad_id(instance)
    reason = _why_not_rewritten(instance, wrapped, pad_id)
    if reason:
        warn_once(
            ("prompt_parity steps aside", reason),
            "sends vLLM the prompts as TRL built them: %s. The parity check still counts "
            "rows whose vLLM prompt differs.",
            reason,
            logger=LOGGER,
        )
        return None
    assert pad_id is not None  # _why_not_rewritten checked it
    sent, left = unexpanded_prompts(prompts, images, pad_id)
    if left:
        warn_once(
            ("prompt_parity runs",),
            "row %d holds %d image pad runs for %d images; it goes to vLLM as built.",
            left[0],
            count_runs(prompts[left[0]], pad_id),
            _images_in(images[left[0]]),
            logger=LOGGER,
        )
    return sent


def generate_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``VLLMGeneration.generate(prompts, images, ...)``: collapse what vLLM gets, generate, compare what it used."""
    bound = bind(wrapped, args, kwargs)
    prompts, images = _as_id_lists(bound.arguments.get("prompts")), bound.arguments.get("images")
    if prompts is None:
        warn_once(
            ("prompt_parity unreadable", type(bound.arguments.get("prompts")).__name__),
            "cannot read prompts of type %s as token id lists: they go to vLLM as given and are not checked.",
            type(bound.arguments.get("prompts")).__name__,
            logger=LOGGER,
        )
        return wrapped(*args, **kwargs)
    has_images = isinstance(images, list) and any(_images_in(row) for row in images)
    sent = _collapsed_for_vllm(instance, wrapped, prompts, images) if has_images else None
    if not has_images:
        _warn_pads_without_images(instance, prompts)
    if sent is not None:
        bound.arguments["prompts"] = sent
        result = wrapped(*bound.args, **bound.kwargs)
    else:
        result = wrapped(*args, **kwargs)
    engine_prompt_ids = result[0] if isinstance(result, tuple) and result else None
    pad_id = _image_pad_id(instance)
    per_row = images if isinstance(images, list) else None
    rows = mismatched_rows(
        engine_prompt_ids,
        prompts,
        pad_id,
        lambda row: image_tokens(instance, per_row[row]) if per_row is not None and row < len(per_row) else None,
    )
    metrics.count(instance, PROMPT_MISMATCH_ROWS, len(rows))  # 0 too: the metric shows the check ran
    if rows:
        _report(instance, rows, engine_prompt_ids, prompts, images, sent)
    return result


def _warn_pads_without_images(generation: Any, prompts: list[list[int]]) -> None:
    """Image pads with no image sent along (a sampled pad fed back in a tool loop): vLLM reads them as text."""
    pad_id = _image_pad_id(generation)
    if pad_id is not None and any(pad_id in ids for ids in prompts):
        warn_once(
            ("prompt_parity pads without images",),
            "a prompt holds image pad tokens but no image goes with it; vLLM reads them "
            "as plain tokens (a sampled placeholder fed back? keep vision_token_guard on).",
            logger=LOGGER,
        )


FIX = Fix(
    name="prompt_parity",
    summary="vLLM gets each image as the one pad it expands; its prompt ids are checked against the trainer's",
    packages=("trl", "vllm"),
    targets=(
        Target(
            _MODULE,
            "VLLMGeneration.generate",
            generate_wrapper,
            required_parameters=("prompts", "images"),
            shape_problem=_shape_problem,
            upstream_fixed=_upstream_sends_unexpanded,
        ),
    ),
    counters=(PROMPT_MISMATCH_ROWS,),
    selftest="trl_vlm_fixes.selftest.checks.prompt_parity:check",
    scope=scope,
    applicability=Applicability(
        modes=VLLM_MODES, aside={"none": "TRL sends vLLM no prompt"}, checkpoint=config_markers
    ),
)
