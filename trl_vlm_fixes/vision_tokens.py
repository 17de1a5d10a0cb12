"""What the Qwen vision-language families share, read from the objects in hand: one resolver for every fix.

- The vision token ids: the processor's own ``image_token_id``/``video_token_id`` first, then TRL's guess on the
  trainer, then the tokenizer's Qwen tokens, then the model config; the spatial merge from the image processor, else
  the vision config.
- The markers (``mm_token_type_ids``: image pad 1, video pad 2) are read by the model's ``get_rope_index``. A model
  whose ``get_rope_index`` is the same code as one of the two implementations the fixes are proven on (Qwen3.5's, which
  Qwen3.5 MoE, Qwen3-VL and Qwen3-VL MoE share line for line, and Qwen2.5-VL's) reads them exactly as those do; any
  other model keeps TRL's markers and prompts. Decided from the code, not from a list of model types, so a new
  checkpoint type that shares the code is covered and one that changes it is not.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .source_shape import function_tree

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# where the proven get_rope_index implementations live (module, class)
PROVEN_ROPE_INDEX = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5Model"),
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
)


@dataclass(frozen=True)
class VisionTokens:
    image: int | None
    video: int | None
    merge: int = 2


def token_id(tokenizer: Any, token: str) -> int | None:
    """``token``'s id, or None where the tokenizer does not know it (its unknown token is no answer)."""
    if tokenizer is None or not hasattr(tokenizer, "convert_tokens_to_ids"):
        return None
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found == getattr(tokenizer, "unk_token_id", None):
        return None
    return found


def _first_int(*candidates: Any) -> int | None:
    return next((int(c) for c in candidates if isinstance(c, int) and not isinstance(c, bool)), None)


def unwrap(model: Any) -> Any:
    """The transformers model under DDP/DeepSpeed (``.module``) and PEFT (``get_base_model``)."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def model_type(model: Any) -> str | None:
    return getattr(getattr(unwrap(model), "config", None), "model_type", None)


def vision_tokens(processing_class: Any, model: Any = None, trainer: Any = None) -> VisionTokens:
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    config = getattr(unwrap(model), "config", None) if model is not None else None
    image = _first_int(
        getattr(processing_class, "image_token_id", None),
        getattr(trainer, "_image_pad_token_id", None),
        token_id(tokenizer, IMAGE_PAD),
        getattr(config, "image_token_id", None),
    )
    video = _first_int(
        getattr(processing_class, "video_token_id", None),
        getattr(trainer, "_video_pad_token_id", None),
        token_id(tokenizer, VIDEO_PAD),
        getattr(config, "video_token_id", None),
    )
    merge = _first_int(
        getattr(getattr(processing_class, "image_processor", None), "merge_size", None),
        getattr(getattr(config, "vision_config", None), "spatial_merge_size", None),
    )
    return VisionTokens(image, video, merge or 2)


def markers_problem(model: Any) -> str | None:
    """Why this model does not read Qwen's vision markers the way the fixes are proven on, or None where it does."""
    inner = unwrap(model)
    kind = model_type(model)
    rope = _rope_index(inner)
    if rope is None:
        return f"model type {kind!r} has no get_rope_index reading vision markers"
    if _code(rope) in _proven_codes():
        return None
    return (
        f"model type {kind!r} reads its vision markers with another get_rope_index than the Qwen3.5/Qwen3-VL or "
        "Qwen2.5-VL one the fixes are proven on"
    )


def _rope_index(inner: Any) -> Callable[..., Any] | None:
    for holder in (inner, getattr(inner, "model", None)):
        function = getattr(type(holder), "get_rope_index", None) if holder is not None else None
        if callable(function):
            return function
    return None


@functools.lru_cache(maxsize=32)
def _code(function: Callable[..., Any]) -> str | None:
    """The function's code as an AST dump without its docstring: formatting, comments and docs do not count."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0]
    return (
        _normalised(definition)
        if isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef)
        else ast.dump(definition)
    )


def _normalised(definition: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        definition.body = body[1:]
    definition.name = "get_rope_index"
    return ast.dump(definition)


@functools.cache
def _proven_codes() -> frozenset[str]:
    """The proven implementations as transformers ships them: read from the source files of the proven classes (and
    their bases, nearest first), not from the class attribute, which a runtime patch (a user's, another library's, a
    test's) may have replaced when this is first asked; a replacement is then another implementation (a
    ``functools.wraps`` wrapper is read through to the code it wraps)."""
    codes: set[str] = set()
    for module_name, class_name in PROVEN_ROPE_INDEX:
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        code = next(filter(None, map(_shipped_rope_index, owner.__mro__)), None)
        if code is not None:
            codes.add(code)
    return frozenset(codes)


def _shipped_rope_index(owner: type) -> str | None:
    """``owner``'s own ``def get_rope_index``, normalised, as written in its source file; None without one."""
    tree = function_tree(owner)  # a class: its source as written (inspect reads the file, not the attributes)
    definition = tree.body[0] if isinstance(tree, ast.Module) and tree.body else None
    if not isinstance(definition, ast.ClassDef):
        return None
    for item in definition.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == "get_rope_index":
            return _normalised(item)
    return None
