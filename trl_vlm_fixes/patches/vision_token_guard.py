"""vision_token_guard: a sampled vision placeholder token never kills a run.

A policy can sample its processor's placeholder tokens (``<|video_pad|>``, ``<|image_pad|>``, ``<|vision_start|>``...;
modelscope/ms-swift#9287). One such token in one completion ends a multi-day GRPO run at the scoring pass:
``get_rope_index`` finds a video marker with no ``video_grid_thw`` (``TypeError: 'NoneType' object is not an
iterator``) or the image features no longer match the image tokens (``ValueError: Image features and image tokens do
not match``). The guard has two parts, both acting where TRL makes and scores a rollout:

- **ban** (``TRL_VLM_FIXES_VISION_TOKEN_GUARD_BAN``): while TRL samples, its placeholders are banned on every path
  TRL 1.9.1 has: vLLM colocate gets them as ``logit_bias`` of -inf (batched on the GPU: free at 128 requests), server
  mode in ``bad_words`` (exact single-token bans, JSON-safe, so the ban travels with the server request; where the
  plugin runs in ``trl vllm-serve`` too, its engine gets them as the same batched -inf ``logit_bias``), transformers
  ``generate`` in ``suppress_tokens``. The user's own settings are kept and ours added; nothing is left on the
  trainer afterwards. Tokens TRL inserts itself (tool results with images) are not sampled and stay untouched.
- **safety net**: a placeholder that still reaches scoring outside TRL's tool-image path (ban off, a custom
  ``rollout_func``) is replaced by the pad token before any forward pass, counted in
  ``trl_vlm_fixes/vision_token_rows_masked``, and the first one logs a WARNING naming the token. Its row is then out
  of everything TRL computes from it, through TRL's own masks, so nothing is corrected after the fact:

  - rewards: every reward function scores it None, TRL's "unscorable" row. TRL gathers the rewards across ranks
    itself, so every rank's group baselines and reward statistics leave the row out and its advantage is 0, with no
    collective of ours;
  - GRPO: its ``tool_mask`` (TRL's mask of the tokens the policy sampled) is 0, so TRL's loss mask, the token count
    ``num_items_in_batch`` it gathers, and its importance-sampling and entropy statistics leave it out;
  - RLOO (no tool mask): its ``completion_mask`` and ``old_logps`` are 0, what TRL computes for a row masked before
    scoring; a masked ``completion_mask`` alone leaves ``old_logps`` at minus hundreds of nats, and ``exp`` of that
    gap in the loss gives inf and NaN gradients.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

from .. import metrics
from ..call_arguments import bind
from ..declaration import Applicability, Counter, Fix, Plan, Target, on_trainers
from ..engine_args import server_is_calling
from ..log_once import warn_once
from ..logs import fix_logger
from ..model_facts import vision_placeholders
from ..owner_state import OwnerState
from ..registry import value
from ..switches import boolean

# Placeholder tokens of the Qwen VLM processors (image, video, audio placeholders and the vision frame markers)
KNOWN_PLACEHOLDERS = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
)
_ID_ATTRIBUTES = ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id", "vision_end_token_id")
_TOKEN_ATTRIBUTES = ("image_token", "video_token", "audio_token", "vision_start_token", "vision_end_token")

LOGGER = fix_logger(__name__)
VISION_TOKEN_ROWS_MASKED = Counter("trl_vlm_fixes/vision_token_rows_masked")
# off: only the safety net (no ban while sampling)
BAN = boolean("ban", "TRL_VLM_FIXES_VISION_TOKEN_GUARD_BAN", True)
_placeholders: OwnerState[dict[int, str]] = OwnerState(dict)
_masked_rows: OwnerState[list[int]] = OwnerState(list)


def placeholder_tokens(trainer: Any) -> dict[int, str]:
    """{token id: token} of every multimodal placeholder the trainer's processor (or model config) defines."""
    cached = _placeholders.get(trainer)
    if cached is not None:
        return cached
    processor = getattr(trainer, "processing_class", None)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "convert_tokens_to_ids"):  # a text-only trainer: nothing to guard
        return {}
    config = getattr(getattr(trainer, "model", None), "config", None)
    candidates: set[int] = set()
    for holder in (processor, tokenizer, config):
        candidates.update(v for a in _ID_ATTRIBUTES if isinstance(v := getattr(holder, a, None), int))
    names = {t for h in (processor, tokenizer) for a in _TOKEN_ATTRIBUTES if isinstance(t := getattr(h, a, None), str)}
    unknown = getattr(tokenizer, "unk_token_id", None)
    for name in names | set(KNOWN_PLACEHOLDERS):
        token_id = tokenizer.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != unknown:
            candidates.add(token_id)
    found = {}
    for token_id in sorted(candidates):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(token, str) and token_id != unknown:
            found[token_id] = token
    _placeholders.set(trainer, found)
    return found


def _with_bad_words(generation_kwargs: dict[str, Any] | None, tokens: list[str]) -> dict[str, Any]:
    """Server mode: words survive the request's JSON (a ``logit_bias`` dict's int keys would arrive as strings, which
    TRL 1.9.1's ``vllm-serve`` passes to ``SamplingParams(**kwargs)`` unconverted)."""
    merged = dict(generation_kwargs or {})
    own = list(merged.get("bad_words") or [])
    merged["bad_words"] = own + [token for token in tokens if token not in own]
    return merged


def _with_logit_bias(generation_kwargs: dict[str, Any] | None, token_ids: list[int]) -> dict[str, Any]:
    """Colocate: a bias of -inf on each placeholder. vLLM 0.25.1 applies ``logit_bias`` batched on the GPU (one indexed
    add for the whole batch, ``LogitBiasLogitsProcessor``), where ``bad_words`` runs in Python per request and step:
    measured at 128 requests on an 8.95B engine, the ban costs nothing with it and 11% with ``bad_words``. TRL builds
    ``SamplingParams(**kwargs)`` directly, so -inf is not clamped: the token's probability is exactly 0."""
    merged = dict(generation_kwargs or {})
    merged["logit_bias"] = {**dict(merged.get("logit_bias") or {}), **dict.fromkeys(token_ids, float("-inf"))}
    return merged


@contextlib.contextmanager
def banned_while_sampling(trainer: Any, placeholders: dict[int, str]) -> Iterator[None]:
    """The placeholders are banned on TRL's generation paths for the duration of one rollout, then put back."""
    restore: list[tuple[Any, str, Any]] = []
    generation = getattr(trainer, "vllm_generation", None) if getattr(trainer, "use_vllm", False) else None
    if generation is not None:  # vLLM SamplingParams: logit_bias in colocate, bad_words through the server's JSON
        restore.append((generation, "generation_kwargs", generation.generation_kwargs))
        if getattr(generation, "mode", None) == "colocate":
            generation.generation_kwargs = _with_logit_bias(generation.generation_kwargs, list(placeholders))
        else:
            generation.generation_kwargs = _with_bad_words(generation.generation_kwargs, list(placeholders.values()))
    config = getattr(trainer, "generation_config", None)
    if config is not None and hasattr(config, "suppress_tokens"):  # transformers generate and continuous batching
        restore.append((config, "suppress_tokens", config.suppress_tokens))
        own = list(config.suppress_tokens or [])
        config.suppress_tokens = own + [t for t in placeholders if t not in own]
    try:
        yield
    finally:
        for holder, attribute, value in restore:
            setattr(holder, attribute, value)


def server_ban_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``vllm.LLM.generate`` inside TRL's ``vllm-serve`` worker: the placeholder words of the request's ``bad_words``
    (banned by the trainer's guard: Python per request and step in vLLM) become the same batched -inf ``logit_bias``
    the colocated engine gets. Elsewhere, and for every other word, the request is left as it came."""
    if not server_is_calling() or _speculative(instance):
        return wrapped(*args, **kwargs)
    try:
        bound = bind(wrapped, args, kwargs)
        params = bound.arguments.get("sampling_params")
        for one in params if isinstance(params, list) else [params]:
            _placeholder_words_as_logit_bias(one, instance)
    except Exception as error:  # noqa: BLE001 - the request still carries its bad_words: never break it
        warn_once(
            ("vision_token_guard server ban", type(error).__name__),
            "the server keeps the request's bad_words ban (not turned into logit_bias: %r).",
            error,
            logger=LOGGER,
        )
        return wrapped(*args, **kwargs)
    return wrapped(*bound.args, **bound.kwargs)


def _speculative(engine: Any) -> bool:
    """vLLM 0.25.1 refuses any logit_bias with speculative decoding (SamplingParams._validate_spec_decode)."""
    config = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    if getattr(config, "speculative_config", None) is None:
        return False
    warn_once(
        ("vision_token_guard server ban", "speculative"),
        "the server decodes speculatively, where vLLM refuses logit_bias: the request's bad_words ban stays as it "
        "came.",
        logger=LOGGER,
    )
    return True


def _placeholder_words_as_logit_bias(params: Any, engine: Any) -> None:
    words = list(getattr(params, "bad_words", None) or [])
    candidates = [word for word in words if word in KNOWN_PLACEHOLDERS]
    if not candidates:
        return
    tokenizer = engine.get_tokenizer()
    unknown = getattr(tokenizer, "unk_token_id", None)
    token_ids = {word: tokenizer.convert_tokens_to_ids(word) for word in candidates}
    moved = {word: t for word, t in token_ids.items() if isinstance(t, int) and t != unknown}
    if not moved:
        return
    params.bad_words = [word for word in words if word not in moved]
    params.logit_bias = {**dict(params.logit_bias or {}), **dict.fromkeys(moved.values(), float("-inf"))}


def _mask_stray_placeholders(trainer: Any, output: Any, placeholders: dict[int, str]) -> Any:
    """Replace placeholders the policy sampled by the pad token; remember their rows, zero them in GRPO's tool mask."""
    if not (isinstance(output, tuple) and len(output) >= 2 and isinstance(output[1], list)):
        return output
    completion_ids = output[1]
    tool_mask = _tool_mask(output)
    banned = placeholders.keys()
    pad = getattr(getattr(trainer, "processing_class", None), "tokenizer", None)
    pad_id = getattr(pad, "pad_token_id", None)
    masked = []
    for row, ids in enumerate(completion_ids):
        if banned.isdisjoint(ids):
            continue
        sampled = tool_mask[row] if tool_mask is not None else None
        stray = [i for i, t in enumerate(ids) if t in banned and (sampled is None or sampled[i])]
        if not stray:
            continue
        if pad_id is None:
            raise RuntimeError(
                f"trl_vlm_fixes.vision_token_guard: row {row} contains the vision placeholder "
                f"{placeholders[ids[stray[0]]]} and the tokenizer has no pad token to replace it; set "
                "tokenizer.pad_token or keep TRL_VLM_FIXES_VISION_TOKEN_GUARD_BAN on."
            )
        first = ids[stray[0]]
        warn_once(
            ("vision_token_guard sampled", first),
            "a completion contains the vision placeholder %s (id %d) sampled by "
            "the policy; it is replaced by the pad token and its row is masked out of the loss (counted in %s).",
            placeholders[first],
            first,
            VISION_TOKEN_ROWS_MASKED.name,
            logger=LOGGER,
        )
        row_ids = list(ids)
        for i in stray:
            row_ids[i] = pad_id
        completion_ids[row] = row_ids
        masked.append(row)
    _masked_rows.setdefault(trainer).extend(masked)
    metrics.count(trainer, VISION_TOKEN_ROWS_MASKED, len(masked))
    if masked and len(output) >= 4 and (output[2] is None or tool_mask is not None):  # GRPO's tool mask slot
        loss_mask = tool_mask or [[1] * len(ids) for ids in completion_ids]
        for row in masked:
            loss_mask[row] = [0] * len(completion_ids[row])
        output = (*output[:2], loss_mask, *output[3:])
    return output


def _tool_mask(output: tuple[Any, ...]) -> list[list[int]] | None:
    """GRPO returns a tool mask third (0: a token TRL inserted itself, a tool result or its image); RLOO does not."""
    candidate = output[2] if len(output) >= 3 else None
    if not isinstance(candidate, list) or len(candidate) != len(output[1]):
        return None
    rows_match = all(
        isinstance(mask, list) and len(mask) == len(ids) and all(isinstance(m, int) for m in mask[:1])
        for mask, ids in zip(candidate, output[1], strict=True)
    )
    return candidate if rows_match else None


def _guarded_placeholders(trainer: Any) -> dict[int, str]:
    placeholders = placeholder_tokens(trainer)
    if not placeholders:
        warn_once(
            ("vision_token_guard steps aside", type(trainer).__name__),
            "steps aside for %s: its processing class defines no vision placeholder token (a text-only model).",
            type(trainer).__name__,
            logger=LOGGER,
        )
    return placeholders


def rollout_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The trainer's ``_generate``: ban while sampling, then catch what still got through."""
    placeholders = _guarded_placeholders(instance)
    if not placeholders:
        return wrapped(*args, **kwargs)
    ban = bool(value("vision_token_guard", BAN.key))
    with banned_while_sampling(instance, placeholders) if ban else contextlib.nullcontext():
        output = wrapped(*args, **kwargs)
    return _mask_stray_placeholders(instance, output, placeholders)


def scoring_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The trainer's ``_generate_and_score_completions``: RLOO's loss gets the masked rows as TRL would mask them."""
    _masked_rows.pop(instance)
    output = wrapped(*args, **kwargs)
    rows = _masked_rows.pop(instance)
    if rows and isinstance(output, dict) and "old_logps" in output:  # RLOO: its loss reads completion_mask alone
        output["completion_mask"][rows] = 0
        output["old_logps"][rows] = 0.0  # sum(old_per_token_logps * completion_mask) of a masked row
    return output


class _UserNones:
    """What the user's own reward functions returned None for, row by row, seen before the guard blanks its rows."""

    def __init__(self, functions: int, masked: list[int]) -> None:
        self.functions = functions
        self.masked = set(masked)
        self.none_rows: list[set[int]] = []
        self.completions: list[Any] = []

    def saw(self, rewards: list[Any], kwargs: dict[str, Any]) -> None:
        self.none_rows.append({row for row, reward in enumerate(rewards) if reward is None})
        self.completions = list(kwargs.get("completions") or self.completions)

    def rows(self) -> list[int]:
        """Rows every user reward function left unscored (a reward model scores every row)."""
        if len(self.none_rows) < self.functions or not self.none_rows:
            return []
        return sorted(set.intersection(*self.none_rows) - self.masked)


class _OnlyOursHidden(logging.Filter):
    """TRL warns once per call about the first row all reward functions returned None for. Where that row is one the
    guard masked, TRL's warning is about the guard, not the user's functions: hidden. A row of the user's own is
    then named by the guard's line instead (``rewards_wrapper``)."""

    def __init__(self, user: _UserNones) -> None:
        super().__init__()
        self.user = user
        self.hid_users_row = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "All reward functions returned None" not in record.getMessage():  # accelerate prefixes "[RANK n]"
            return True
        users = self.user.rows()
        if users and users[0] < min(self.user.masked):
            return True  # TRL names the user's own row: its warning stands
        self.hid_users_row = bool(users)
        return False


def _scored_none(func: Any, rows: list[int], hooks: list[Any], user: _UserNones) -> Any:
    """``func`` as TRL calls it, scoring None (NaN for a reward model) on ``rows``."""
    import torch

    def blank(rewards: list[Any], kwargs: dict[str, Any]) -> list[Any]:
        user.saw(rewards, kwargs)
        return [None if row in rows else reward for row, reward in enumerate(rewards)]

    if isinstance(func, torch.nn.Module):  # TRL reads .logits[:, 0], under inference_mode

        def nan_rows(module: Any, args: Any, output: Any) -> None:
            output.logits[rows] = torch.nan

        user.none_rows.append(set())  # a model scores every row
        hooks.append(func.register_forward_hook(nan_rows))
        return func
    if inspect.iscoroutinefunction(func):

        async def scored_async(**kwargs: Any) -> list[Any]:
            return blank(await func(**kwargs), kwargs)

        return scored_async

    def scored(**kwargs: Any) -> list[Any]:
        return blank(func(**kwargs), kwargs)

    return scored


def rewards_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The trainer's ``_calculate_rewards``: masked rows are unscorable before TRL gathers the rewards of all ranks."""
    rows = _masked_rows.get(instance)
    if not rows:
        return wrapped(*args, **kwargs)
    funcs = instance.reward_funcs
    hooks: list[Any] = []
    user = _UserNones(len(funcs), rows)
    trl_logger = logging.getLogger(getattr(wrapped, "__module__", None) or "trl")
    quiet = _OnlyOursHidden(user)
    instance.reward_funcs = [_scored_none(func, rows, hooks, user) for func in funcs]
    trl_logger.addFilter(quiet)
    try:
        return wrapped(*args, **kwargs)
    finally:
        trl_logger.removeFilter(quiet)
        instance.reward_funcs = funcs
        for hook in hooks:
            hook.remove()
        if quiet.hid_users_row:
            row = user.rows()[0]
            completion = user.completions[row] if row < len(user.completions) else "?"
            LOGGER.warning(
                "All reward functions returned None for row %d (completion: %r). Please ensure that at least one "
                "reward function returns a valid reward. (TRL's own warning named a row the guard masked instead.)",
                row,
                completion,
            )


def scope(trainer: Any) -> str | None:
    if not placeholder_tokens(trainer):
        return "its processing class defines no vision placeholder token (a text-only model)"
    return None


def config_placeholders(plan: Plan) -> str | None:
    """``scope`` before the trainer exists: the placeholders a checkpoint's config declares (every sampling path)."""
    if not vision_placeholders(plan.config) and "vision_config" not in plan.config:
        return "its config defines no vision placeholder token (a text-only model)"
    return None


FIX = Fix(
    name="vision_token_guard",
    summary="sampled vision placeholder tokens are banned, and masked out of the loss if one still gets through",
    packages=("trl",),
    targets=(
        *on_trainers(
            {
                "_generate": rollout_wrapper,
                "_calculate_rewards": rewards_wrapper,
                "_generate_and_score_completions": scoring_wrapper,
            }
        ),
        # trl vllm-serve's engine (only where vLLM is installed: its absence is not a skip)
        Target("vllm.entrypoints.llm", "LLM.generate", server_ban_wrapper, optional=True),
    ),
    settings=(BAN,),
    counters=(VISION_TOKEN_ROWS_MASKED,),
    selftest="trl_vlm_fixes.selftest.checks.vision_token_guard:check",
    scope=scope,
    applicability=Applicability(checkpoint=config_placeholders),
)
