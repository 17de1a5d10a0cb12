"""TRL >= 1.11's ``trl vllm-serve`` replaces itself (``os.execve``) with vLLM's own server,
``python -m vllm.entrypoints.cli.main serve ...`` (huggingface/trl#6765): no frame of TRL's is left where that engine
is configured, and it is built through ``AsyncLLM``, not ``LLM(...)``, so the engine fixes cannot reach it. Under the
launcher the plugin loads in that process too; there it says once which of vLLM's own flags (``trl vllm-serve``
forwards them) give the server's engine the settings the fixes would have given it: the pinned CUDA-graph mode and the
prefill backend now, and the ``compilation_config`` that protects it after the trainer's watchdog reports a server
generate that never returned (no process of the server can read that report)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .logs import fix_logger
from .moe_backend import has_routed_experts
from .patches.cudagraph import AUTO, HANG_MODE, PROTECTED_MODE, selected_mode
from .patches.gdn_prefill import kernel_gone_reason, selected_backend
from .registry import active

LOGGER = fix_logger(__name__)

# What TRL 1.16's build_command execs: the interpreter, then these, then the model; plus flags only TRL adds
TRL_SERVER_COMMAND = ["-m", "vllm.entrypoints.cli.main", "serve"]
TRL_SERVER_FLAG = "--weight-transfer-config"
# Model types whose transformers config puts `linear_attention` layers in `layer_types` when config.json omits them
GATED_DELTANET_MODEL_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}


def started_by_trl_vllm_serve(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Is this process vLLM's server as TRL >= 1.11's ``trl vllm-serve`` execs it?"""
    return (
        list(argv[1:4]) == TRL_SERVER_COMMAND and environ.get("VLLM_SERVER_DEV_MODE") == "1" and TRL_SERVER_FLAG in argv
    )


def _options(argv: Sequence[str]) -> list[tuple[str, str]]:
    """(name, value) of every ``--option``/``-cc`` in ``argv``, named as vLLM reads them (``_`` as ``-``, as TRL's
    YAML config writes them: ``--compilation_config``), the value given with ``=`` or as the next argument."""
    options = []
    for index, argument in enumerate(argv):
        if not argument.startswith("-"):
            continue
        name, equals, value = argument.partition("=")
        if not equals and index + 1 < len(argv) and not argv[index + 1].startswith("-"):
            value = argv[index + 1]
        options.append((name[:2] + name[2:].replace("_", "-") if name.startswith("--") else name, value))
    return options


def _sets_cudagraph_mode(options: list[tuple[str, str]]) -> bool:
    """A compilation config that sets ``cudagraph_mode``: as JSON (``--compilation-config``, ``-cc``) or dotted
    (``-cc.cudagraph_mode=...``, ``--compilation-config.cudagraph_mode ...``)."""
    for name, value in options:
        base, _, field = name.partition(".")
        dotted = field.replace("_", "-") == "cudagraph-mode"
        if base in ("--compilation-config", "-cc") and (dotted or "cudagraph_mode" in value):
            return True
    return False


def compilation_flag(mode: str) -> str:
    """vLLM's server flag for ``cudagraph_mode`` (``trl vllm-serve`` forwards it)."""
    return f'--compilation-config \'{{"cudagraph_mode": "{mode}"}}\''


def flags_to_pass(argv: Sequence[str]) -> list[str]:
    """The flags that give vLLM's server the fixes' engine settings now (a pinned CUDA-graph mode, the prefill
    backend), less those the command already has."""
    options = _options(argv)
    flags = []
    if active().is_enabled("cudagraph") and selected_mode() != AUTO and not _sets_cudagraph_mode(options):
        flags.append(compilation_flag(selected_mode()))
    prefill_needed = active().is_enabled("gdn_prefill") and kernel_gone_reason() is None
    if prefill_needed and "--gdn-prefill-backend" not in dict(options):
        flags.append(f"--gdn-prefill-backend {selected_backend()}")
    return flags


def protection_flag(argv: Sequence[str]) -> str | None:
    """The flag that protects the server's engine after a hang (``PIECEWISE``), where the server keeps vLLM's own
    CUDA graphs (mode ``auto``, no ``cudagraph_mode`` in the command): None elsewhere."""
    armed = active().is_enabled("cudagraph") and selected_mode() == AUTO
    return compilation_flag(HANG_MODE) if armed and not _sets_cudagraph_mode(_options(argv)) else None


def served_model(argv: Sequence[str]) -> str | None:
    """The model TRL's command serves: the argument right after ``serve``."""
    model = argv[4] if len(argv) > 4 else ""
    return model if model and not model.startswith("-") else None


def served_model_config(argv: Sequence[str]) -> dict[str, Any] | None:
    """The ``config.json`` of the served model: from its folder, or from the Hugging Face cache at the ``--revision``
    given. Read as JSON, not through transformers: this runs before vLLM's start-up, which must come before anything
    imports torch; and nothing is downloaded or run (remote code)."""
    model = served_model(argv)
    if model is None:
        return None
    path = Path(model)
    if path.exists():
        config_file = path / "config.json"
        return json.loads(config_file.read_text()) if config_file.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model, "config.json", revision=dict(_options(argv)).get("--revision"))
    return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None


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


def served_model_has_gated_deltanet(argv: Sequence[str]) -> bool | None:
    """Has the served model Gated-DeltaNet layers? None: its config could not be read here or does not tell."""
    try:
        config = served_model_config(argv)
        return None if config is None else has_gated_deltanet_layers_in_json(config)
    except Exception as error:  # noqa: BLE001 - unreadable here: the advice stays conditional
        LOGGER.debug("cannot read the served model's config: %r", error)
        return None


def expert_flag_to_pass(argv: Sequence[str]) -> str | None:
    """``--moe-backend triton`` for a served model with routed experts, unless the command names a backend: vLLM's
    FlashInfer MoE backends (its default on Blackwell) rearrange the experts after loading, and TRL's weight push
    never re-runs that step (expert_layout). Which backend this GPU would get is not asked here: that needs torch,
    which must not be imported before vLLM's start-up; on Hopper Triton is vLLM's default anyway."""
    if not active().is_enabled("expert_layout") or "--moe-backend" in dict(_options(argv)):
        return None
    try:
        config = served_model_config(argv)
    except Exception as error:  # noqa: BLE001 - unreadable here: nothing is claimed
        LOGGER.debug("cannot read the served model's config: %r", error)
        return None
    return "--moe-backend triton" if config is not None and has_routed_experts(config) else None


def advise_trl_server(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> None:
    """One line in vLLM's server started by ``trl vllm-serve``: a WARNING naming the flags the fixes would set when
    they are missing for a Gated-DeltaNet model, or why none are needed for a model without such layers."""
    argv = sys.orig_argv if argv is None else argv
    try:
        if not started_by_trl_vllm_serve(argv, os.environ if environ is None else environ):
            return
        flags, protection = flags_to_pass(argv), protection_flag(argv)
        gated_deltanet = served_model_has_gated_deltanet(argv) if flags or protection else None
        expert_flag = expert_flag_to_pass(argv)
    except Exception as error:  # noqa: BLE001 - advice must never break the server's start
        LOGGER.debug("no server advice: %r", error)
        return
    server = (
        "this is vLLM's own server, which `trl vllm-serve` (TRL >= 1.11) starts in its place: the "
        "engine fixes cannot reach its engine"
    )
    if expert_flag:
        LOGGER.warning(
            "%s. The served model (%s) has routed experts: pass %s to `trl vllm-serve` (vLLM's FlashInfer MoE "
            "backends, its default on Blackwell, rearrange the experts after loading and TRL's weight push would "
            "leave them in the wrong layout; on Hopper it is vLLM's default already).",
            server,
            served_model(argv),
            expert_flag,
        )
    if not flags and not protection:
        return
    if gated_deltanet is False:
        LOGGER.warning(
            "%s; none is needed: the served model (%s) has no Gated-DeltaNet layers.", server, served_model(argv)
        )
        return
    model = (
        f"The served model ({served_model(argv)}) has Gated-DeltaNet layers"
        if gated_deltanet
        else "For a Qwen3.5 (Gated-DeltaNet) model (this one's config could not be read here)"
    )
    advice = (
        f"pass {' '.join(flags)} to `trl vllm-serve` (it forwards vLLM's flags; in a YAML config, the compilation "
        "config as a JSON string)"
        if flags
        else "no flag is needed to start"
    )
    if protection:
        advice += (
            f". It keeps vLLM's own CUDA graphs (the fastest decode): if the trainer's watchdog reports a server "
            f"generate that never returned (a wedged engine), restart the server with {protection} "
            f"({PROTECTED_MODE} after a second hang at the same step)"
        )
    LOGGER.warning("%s. %s: %s.", server, model, advice)
