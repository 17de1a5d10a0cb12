"""vLLM's real model class for a checkpoint, built on the CPU: what a colocated engine's ``model_runner.model`` is.

TRL's colocated weight push (``VLLMGeneration.sync_weights``) hands every trainer tensor to
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])``: vLLM's own model
class (``Qwen3_5MoeForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``...) maps the name, fuses and
shards it into its parameters (``qkv_proj``, the experts' ``w13_weight``/``w2_weight``...). This module builds that
class the way vLLM's loader does (``get_model_loader(load_config).load_model``: the model, the checkpoint's weights,
then ``process_weights_after_loading``), so a test can push into it and read every parameter back.

On a machine without a GPU build of vLLM, vLLM resolves its platform to ``UnspecifiedPlatform``, on which no model
builds (no ``current_device``, no MoE backend: the unquantized MoE oracle has no list for it). vLLM's own CPU build
resolves to ``CpuPlatform`` instead; ``cpu_platform()`` gives the platform object every vLLM module already holds
(``from vllm.platforms import current_platform``) that class while a block runs, and gives it back afterwards. On
``CpuPlatform`` the unquantized FusedMoE runs vLLM's CPU backend; without vLLM's CPU kernels (``vllm._C``, absent
from the GPU wheel) that is the torch path (``CPUFusedMOE.init_moe_torch``: per-expert views of ``w13_weight`` and
``w2_weight``, no rearrangement). A world of one process (gloo) stands for tensor and pipeline parallelism.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_lock = threading.RLock()
# CPU features for which vLLM's CPU post-load step packs weights with its own kernels (``vllm._C``, absent from the
# GPU wheel) without checking that they exist: 0.25.1 packs conv weights on AMX, 0.31.0 on AVX-512 BF16
# (``dispatch_cpu_unquantized_gemm``). Reported absent, so vLLM takes its portable torch paths, which keep every
# weight where the loader put it (as a CPU without them would).
_ISA_PROBES = ("_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_avx512_bf16_supported")
_distributed: list[bool] = []  # one entry once vLLM's one-process world exists in this process


class VllmModelUnavailable(RuntimeError):
    """vLLM's model class for this checkpoint cannot be built here (vLLM missing or too different, no model class)."""


@dataclass
class VllmModel:
    """One built vLLM model and the config it was built with (``moe_backends``: each FusedMoE layer's backend)."""

    model: Any  # torch.nn.Module: the class vLLM's registry names for the checkpoint's architecture
    vllm_config: Any
    moe_backends: dict[str, str]

    def parameters(self) -> dict[str, Any]:
        """Every parameter of the vLLM model by its vLLM name (a detached view: what the kernels read)."""
        return {name: parameter.detach() for name, parameter in self.model.named_parameters()}


@contextmanager
def cpu_platform() -> Iterator[None]:
    """While the block runs, vLLM's platform object is a ``CpuPlatform`` (as on vLLM's CPU build), whichever module
    reads it; afterwards it is what it was. Nested uses are fine."""
    try:
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform
    except Exception as error:  # any import failure means the same here: no vLLM platform to use
        raise VllmModelUnavailable(f"vLLM's CPU platform cannot be imported ({error!r})") from error

    import torch

    with _lock:
        platform = platforms.current_platform
        saved_class = type(platform)
        saved_probes = {name: getattr(torch.cpu, name) for name in _ISA_PROBES if hasattr(torch.cpu, name)}
        if not isinstance(platform, CpuPlatform):
            platform.__class__ = CpuPlatform  # the one object every vLLM module bound at import
        for name in saved_probes:
            setattr(torch.cpu, name, _absent)
        try:
            yield
        finally:
            platform.__class__ = saved_class
            for name, probe in saved_probes.items():
                setattr(torch.cpu, name, probe)


def _absent() -> bool:
    return False


def checkpoint_overrides(model_dir: str | Path) -> dict[str, Any]:
    """Config fields vLLM needs that a checkpoint written by transformers 5 lacks. transformers 5 dropped
    ``norm_topk_prob`` from ``Qwen3VLMoeTextConfig`` (its router always renormalises the top-k weights), while vLLM's
    ``Qwen3MoeSparseMoeBlock`` (0.25.1 and 0.31.0, ``qwen3_moe.py``) reads ``config.norm_topk_prob``: the same
    semantics, said to vLLM. Released checkpoints carry the field and get nothing here."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = config.get("text_config") or {}
    if config.get("model_type") == "qwen3_vl_moe" and "norm_topk_prob" not in text:
        return {"text_config": {"norm_topk_prob": True}}
    return {}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _one_process_world(vllm_config: Any) -> None:
    """vLLM's distributed state for one rank (gloo): the model's parallel layers ask it for their rank and size."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if _distributed or model_parallel_is_initialized():
        _distributed.append(True)
        return
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    _distributed.append(True)


def _moe_backends(model: Any) -> dict[str, str]:
    backends = {}
    for name, module in model.named_modules():
        backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
        if backend is not None:
            backends[name] = str(getattr(backend, "name", backend))
    return backends


def build_vllm_model(
    model_dir: str | Path,
    load_format: str = "auto",
    hf_overrides: Mapping[str, Any] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
) -> VllmModel:
    """vLLM's model class for ``model_dir`` on the CPU in float32, loaded by vLLM's own loader (``load_format``:
    ``auto`` reads the checkpoint, ``dummy`` draws random weights). ``engine_kwargs`` go to ``EngineArgs`` as
    ``LLM(...)`` would pass them (``moe_backend``...). Raises ``VllmModelUnavailable`` where vLLM cannot build it."""
    from .vllm_processor import transformers_config_classes_kept
    from .vllm_sampler import _unpin

    try:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model_loader
    except Exception as error:  # any import failure means the same here: no model
        raise VllmModelUnavailable(f"vLLM's model loader cannot be imported ({error!r})") from error

    _unpin()  # UnspecifiedPlatform claimed pinned memory at import; pinning needs a CUDA driver
    overrides = {**checkpoint_overrides(model_dir), **(hf_overrides or {})}
    with _lock, cpu_platform():
        try:
            with transformers_config_classes_kept():
                vllm_config = EngineArgs(
                    model=str(model_dir),
                    dtype="float32",
                    enforce_eager=True,
                    load_format=load_format,
                    hf_overrides=overrides,
                    max_model_len=256,
                    **dict(engine_kwargs or {}),
                ).create_engine_config()
            _one_process_world(vllm_config)
            with set_current_vllm_config(vllm_config), torch.device("cpu"):
                model = get_model_loader(vllm_config.load_config).load_model(
                    vllm_config=vllm_config, model_config=vllm_config.model_config
                )
        except VllmModelUnavailable:
            raise
        except Exception as error:
            raise VllmModelUnavailable(f"vLLM cannot build the model of {model_dir} on the CPU: {error!r}") from error
    return VllmModel(model=model, vllm_config=vllm_config, moe_backends=_moe_backends(model))
