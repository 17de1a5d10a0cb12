"""TRL >= 1.11's ``trl vllm-serve`` replaces itself (``os.execve``) with vLLM's own server,
``python -m vllm.entrypoints.cli.main serve ...`` (huggingface/trl#6765): no frame of TRL's is left where that engine
is configured, and it is built through ``AsyncLLM``, not ``LLM(...)``, so the engine fixes cannot reach it. Under the
launcher the plugin loads in that process too; there it says once which of vLLM's own flags (``trl vllm-serve``
forwards them) give the server's engine the settings the fixes would have given it."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence

from .engine_args import has_gated_deltanet_layers
from .patches.cudagraph import selected_mode
from .patches.gdn_prefill import kernel_gone, selected_backend
from .switches import fix_enabled

LOGGER = logging.getLogger("trl_vlm_fixes")

# What TRL 1.16's build_command execs: the interpreter, then these, then the model; plus flags only TRL adds
TRL_SERVER_COMMAND = ["-m", "vllm.entrypoints.cli.main", "serve"]
TRL_SERVER_FLAG = "--weight-transfer-config"


def started_by_trl_vllm_serve(argv: Sequence[str], environ: Mapping[str, str]) -> bool:
    """Is this process vLLM's server as TRL >= 1.11's ``trl vllm-serve`` execs it?"""
    return (
        list(argv[1:4]) == TRL_SERVER_COMMAND
        and environ.get("VLLM_SERVER_DEV_MODE") == "1"
        and TRL_SERVER_FLAG in argv
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


def flags_to_pass(argv: Sequence[str]) -> list[str]:
    """The flags that give vLLM's server the fixes' engine settings, less those the command already has."""
    options = _options(argv)
    flags = []
    if fix_enabled("cudagraph") and not _sets_cudagraph_mode(options):
        flags.append(f"--compilation-config '{{\"cudagraph_mode\": \"{selected_mode()}\"}}'")
    if fix_enabled("gdn_prefill") and kernel_gone() is None and "--gdn-prefill-backend" not in dict(options):
        flags.append(f"--gdn-prefill-backend {selected_backend()}")
    return flags


def served_model_has_gated_deltanet(argv: Sequence[str]) -> bool | None:
    """Has the model TRL's command serves (right after ``serve``) Gated-DeltaNet layers? ``None`` when its config is
    not on this machine yet: the advice must not download anything before the server does."""
    model = argv[4] if len(argv) > 4 else ""
    if not model or model.startswith("-"):
        return None
    try:
        from transformers import AutoConfig

        return has_gated_deltanet_layers(AutoConfig.from_pretrained(model, local_files_only=True))
    except Exception as error:  # noqa: BLE001 - unreadable here: the advice stays conditional
        LOGGER.debug("trl_vlm_fixes: cannot read the config of %s: %r", model, error)
        return None


def advise_trl_server(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> None:
    """One line in vLLM's server started by ``trl vllm-serve``: a WARNING naming the flags the fixes would set when
    they are missing for a Gated-DeltaNet model, or why none are needed for a model without such layers."""
    argv = sys.orig_argv if argv is None else argv
    try:
        if not started_by_trl_vllm_serve(argv, os.environ if environ is None else environ):
            return
        flags = flags_to_pass(argv)
        gated_deltanet = served_model_has_gated_deltanet(argv) if flags else None
    except Exception as error:  # noqa: BLE001 - advice must never break the server's start
        LOGGER.debug("trl_vlm_fixes: no server advice: %r", error)
        return
    if not flags:
        return
    server = (
        "trl_vlm_fixes: this is vLLM's own server, which `trl vllm-serve` (TRL >= 1.11) starts in its place: the "
        "engine fixes cannot reach its engine"
    )
    if gated_deltanet is False:
        LOGGER.warning("%s; none is needed: the served model (%s) has no Gated-DeltaNet layers.", server, argv[4])
        return
    model = (
        f"The served model ({argv[4]}) has Gated-DeltaNet layers"
        if gated_deltanet
        else "For a Qwen3.5 (Gated-DeltaNet) model (this one's config is not on this machine yet)"
    )
    LOGGER.warning(
        "%s. %s: pass %s to `trl vllm-serve` (it forwards vLLM's flags; in a YAML config, the compilation config as "
        "a JSON string).",
        server,
        model,
        " ".join(flags),
    )
