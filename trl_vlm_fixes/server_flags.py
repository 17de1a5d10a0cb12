"""TRL >= 1.11's ``trl vllm-serve`` replaces itself (``os.execve``) with vLLM's own server,
``python -m vllm.entrypoints.cli.main serve ...`` (huggingface/trl#6765): no frame of TRL's is left where that engine
is configured, and it is built through ``AsyncLLM``, not ``LLM(...)``, so the engine fixes cannot reach it. Under the
launcher the plugin loads in that process too; there it says once which of vLLM's own flags (``trl vllm-serve``
forwards them) give the server's engine the settings the fixes would have given it: the pinned CUDA-graph mode and the
prefill backend now, and the ``compilation_config`` that protects it after the trainer's watchdog reports a server
generate that never returned (no process of the server can read that report). Each engine fix declares its flags
(``Fix.server_advice``), read here through the registry: this module imports no fix."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .declaration import ServerAdvice
from .logs import fix_logger
from .model_facts import has_gated_deltanet_layers_in_json
from .moe_backend import has_routed_experts
from .registry import active

LOGGER = fix_logger(__name__)

# What TRL 1.16's build_command execs: the interpreter, then these, then the model; plus flags only TRL adds
TRL_SERVER_COMMAND = ["-m", "vllm.entrypoints.cli.main", "serve"]
TRL_SERVER_FLAG = "--weight-transfer-config"


def started_by_trl_vllm_serve(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Is this process vLLM's server as TRL >= 1.11's ``trl vllm-serve`` execs it?"""
    return (
        list(argv[1:4]) == TRL_SERVER_COMMAND and environ.get("VLLM_SERVER_DEV_MODE") == "1" and TRL_SERVER_FLAG in argv
    )


def command_options(argv: Sequence[str]) -> list[tuple[str, str]]:
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


def fixes_advice(argv: Sequence[str]) -> list[ServerAdvice]:
    """What each enabled fix that declares ``server_advice`` would give the server's engine, in the fixes' order."""
    registry = active()
    return [
        fix.server_advice(argv)
        for name, fix in registry.fixes.items()
        if fix.server_advice is not None and registry.is_enabled(name)
    ]


def flags_to_pass(argv: Sequence[str]) -> list[str]:
    """The flags that give vLLM's server the fixes' engine settings now (a pinned CUDA-graph mode, the prefill
    backend), less those the command already has."""
    return [flag for advice in fixes_advice(argv) for flag in advice.flags]


def _hang_advice(advised: list[ServerAdvice]) -> ServerAdvice | None:
    return next((advice for advice in advised if advice.after_hang), None)


def protection_flag(argv: Sequence[str]) -> str | None:
    """The flag that protects the server's engine after a hang (``PIECEWISE``), where the server keeps vLLM's own
    CUDA graphs (mode ``auto``, no ``cudagraph_mode`` in the command): None elsewhere."""
    hang = _hang_advice(fixes_advice(argv))
    return None if hang is None else hang.after_hang


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

    cached = try_to_load_from_cache(model, "config.json", revision=dict(command_options(argv)).get("--revision"))
    return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None


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
    if not active().is_enabled("expert_layout") or "--moe-backend" in dict(command_options(argv)):
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
        advised = fixes_advice(argv)
        flags, hang = [flag for advice in advised for flag in advice.flags], _hang_advice(advised)
        gated_deltanet = served_model_has_gated_deltanet(argv) if flags or hang else None
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
    if not flags and not hang:
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
    if hang is not None:
        advice += (
            f". It keeps vLLM's own CUDA graphs (the fastest decode): if the trainer's watchdog reports a server "
            f"generate that never returned (a wedged engine), restart the server with {hang.after_hang} "
            f"({hang.after_repeated_hang} after a second hang at the same step)"
        )
    LOGGER.warning("%s. %s: %s.", server, model, advice)
