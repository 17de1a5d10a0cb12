"""What a checkpoint's ``config.json`` says about the layers the fixes depend on, read as JSON (no torch).

``trl-vlm-fixes status --model`` must tell a user which fixes act for their checkpoint before a long run, on a machine
that may have neither a GPU nor the model's weights. The facts are the ones the fixes decide on at run time, from the
same fields: Gated-DeltaNet layers (``linear_attention`` in ``layer_types``, ``has_gated_deltanet_layers_in_json``,
which ``server_flags`` asks too in vLLM's own server), routed experts (a positive expert count,
``moe_backend.has_routed_experts``), Qwen3-VL's deepstack, the vision placeholders, and whether the model's
``get_rope_index`` is one the markers are proven on (``vision_tokens``), compared as code read from the
installed transformers' source file rather than from the imported class, so that no torch is needed.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .moe_backend import has_routed_experts
from .vision_tokens import PROVEN_ROPE_INDEX, _normalised

__all__ = [
    "deepstack_levels",
    "has_gated_deltanet",
    "has_gated_deltanet_layers_in_json",
    "has_routed_experts",
    "markers_problem",
    "read_config",
    "shares_one_placeholder",
    "vision_placeholders",
]
# Model types whose transformers config puts `linear_attention` layers in `layer_types` when config.json omits them
GATED_DELTANET_MODEL_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}


def read_config(model: str | Path) -> dict[str, Any]:
    """The checkpoint's ``config.json``: from its folder, or from the Hugging Face cache (never downloaded)."""
    path = Path(model)
    if path.is_file() and path.name.endswith(".json"):
        return dict(json.loads(path.read_text()))
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return dict(json.loads(config_file.read_text()))
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError as error:
        raise FileNotFoundError(f"{model} is not a folder, and huggingface_hub is not installed") from error
    cached = try_to_load_from_cache(str(model), "config.json")
    if not isinstance(cached, str):
        raise FileNotFoundError(f"{model} is neither a folder nor in the Hugging Face cache (nothing is downloaded)")
    return dict(json.loads(Path(cached).read_text()))


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = config.get(name)
    return value if isinstance(value, Mapping) else {}


def has_gated_deltanet_layers_in_json(config: Mapping[str, Any]) -> bool | None:
    """``linear_attention`` in the (text) config's ``layer_types``; a config that leaves them out is read by its
    model type, where transformers' own default has them; None where the config cannot tell."""
    text = config.get("text_config") or config
    layer_types = text.get("layer_types")
    if layer_types is not None:
        return "linear_attention" in layer_types
    if {config.get("model_type"), text.get("model_type")} & GATED_DELTANET_MODEL_TYPES:
        return True
    return None


def has_gated_deltanet(config: Mapping[str, Any]) -> bool:
    """Gated-DeltaNet layers, as the engine fixes' ``acts_on`` reads them (``linear_attention`` layers)."""
    return has_gated_deltanet_layers_in_json(config) is True


def deepstack_levels(config: Mapping[str, Any]) -> int:
    """How many deepstack tensors the served model keeps outside its parameters and buffers (Qwen3-VL's)."""
    indexes = _section(config, "vision_config").get("deepstack_visual_indexes")
    return len(indexes) if isinstance(indexes, list) else 0


def vision_placeholders(config: Mapping[str, Any]) -> dict[str, int]:
    """The vision placeholder token ids the config declares (``image_token_id``, ``video_token_id``)."""
    return {
        key: value
        for key in ("image_token_id", "video_token_id")
        if isinstance(value := config.get(key), int) and not isinstance(value, bool)
    }


def shares_one_placeholder(config: Mapping[str, Any]) -> bool:
    """Images and videos under one placeholder token (GLM-4V): their markers cannot be told apart."""
    placeholders = vision_placeholders(config)
    return len(placeholders) == 2 and len(set(placeholders.values())) == 1


def markers_problem(config: Mapping[str, Any]) -> str | None:
    """Why this model does not read Qwen's vision markers as the fixes are proven on (``vision_tokens``' words), or
    None: its ``get_rope_index``, as the installed transformers ships it, is one of the proven implementations."""
    kind = config.get("model_type")
    codes = _rope_index_codes(str(kind)) if isinstance(kind, str) else None
    if codes is None:
        return f"model type {kind!r} is not in the installed transformers, so its get_rope_index cannot be read"
    if not codes:
        return f"model type {kind!r} has no get_rope_index reading vision markers"
    if codes <= _proven_codes():
        return None
    return (
        f"model type {kind!r} reads its vision markers with another get_rope_index than the Qwen3.5/Qwen3-VL or "
        "Qwen2.5-VL one the fixes are proven on"
    )


def _module_file(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)  # imports the parent packages only: transformers' are lazy
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


@functools.cache
def _rope_index_codes(model_type: str, owner: str | None = None) -> frozenset[str] | None:
    """Every ``get_rope_index`` defined in the model type's modeling file (of class ``owner`` only, if given),
    normalised as ``vision_tokens`` compares them; None where transformers has no such model."""
    name = model_type.replace("-", "_")
    source = _module_file(f"transformers.models.{name}.modeling_{name}")
    if source is None:
        return None
    codes = set()
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and owner in (None, node.name):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == "get_rope_index":
                    codes.add(_normalised(item))
    return frozenset(codes)


def _proven_codes() -> frozenset[str]:
    proven: set[str] = set()
    for module, owner in PROVEN_ROPE_INDEX:
        model_type = module.rpartition(".modeling_")[2]
        proven |= _rope_index_codes(model_type, owner) or frozenset()
    return frozenset(proven)
