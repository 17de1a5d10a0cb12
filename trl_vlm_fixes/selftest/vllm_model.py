"""vLLM's real model class for a checkpoint, built on the CPU: what a colocated engine's ``model_runner.model`` is.

TRL's colocated weight push (``VLLMGeneration.sync_weights``) hands every trainer tensor to
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])``: vLLM's own model
class (``Qwen3_5MoeForConditionalGeneration``, ``Qwen3VLMoeForConditionalGeneration``...) maps the name, fuses and
shards it into its parameters (``qkv_proj``, the experts' ``w13_weight``/``w2_weight``...). This module builds that
class the way vLLM's loader does (``get_model_loader(load_config).load_model``: the model, the checkpoint's weights,
then ``process_weights_after_loading``), so a test can push into it and read every parameter back.

On a machine without a GPU build of vLLM, vLLM resolves its platform to ``UnspecifiedPlatform``, on which no model
builds (no ``current_device``; the unquantized MoE oracle has no backend list for it). vLLM's own CPU build resolves
to ``CpuPlatform``; ``cpu_platform()`` gives the platform object every vLLM module already holds (``from vllm.platforms
import current_platform``) that class while a block runs, and its class back afterwards. vLLM's CPU post-load steps
call its CPU kernels (``vllm._C``, not in the GPU wheel) on CPUs with AMX / AVX-512 BF16 without checking that they
exist; the block reports those features absent, so the portable torch paths run. The experts get the backend vLLM
picks on Hopper, Triton (``moe_backend_selected``), or one named by the caller (FlashInfer CUTLASS, to see a backend
that rearranges ``w13`` after loading): their post-load step is vLLM's own, and plain torch for both. A world of one
process (gloo) stands for tensor and pipeline parallelism. Building takes about 0.5 s (6 s with vLLM's import).
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
_world_owned: list[bool] = []  # set once this module made vLLM's world: [whether it made torch.distributed's too]
HOPPER_MOE_BACKEND = "TRITON"  # what vLLM 0.25.1 picks for unquantized experts on SM90 (oracle/unquantized.py)
# CPU features for which vLLM's CPU post-load step packs weights with its own kernels (``vllm._C``, absent from the
# GPU wheel) without checking that they exist: 0.25.1 packs conv weights on AMX, 0.31.0 on AVX-512 BF16
# (``dispatch_cpu_unquantized_gemm``). Reported absent, so vLLM takes its portable torch paths, which keep every
# weight where the loader put it (as a CPU without them would).
_ISA_PROBES = ("_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_avx512_bf16_supported")


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
    """vLLM's distributed state for one rank (gloo): the model's parallel layers ask it for their rank and size while
    they are built and while weights load (a push included)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    owned = not torch.distributed.is_initialized()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    _world_owned[:] = [owned]


def release_world() -> None:
    """Take down the world ``build_vllm_model`` set up (torch.distributed's process group too, if it made it), so
    that later code in this process (a test session) finds none; models built before cannot load weights after."""
    if not _world_owned:
        return
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    if _world_owned[0]:
        destroy_distributed_environment()
    _world_owned.clear()


@contextmanager
def moe_backend_selected(backend: str | None) -> Iterator[None]:
    """While the block runs, every unquantized FusedMoE layer built gets ``backend`` (a member name of vLLM's
    ``UnquantizedMoeBackend``: ``TRITON``, ``FLASHINFER_CUTLASS``...) and vLLM's own kernel class for it, whatever the
    platform; None leaves the choice to vLLM. vLLM's oracle offers no GPU backend on the CPU platform, and its CPU
    backend does not keep the loader's layout everywhere (0.31 prepacks with ``vllm._C``); the weights are what is
    compared here, and a GPU backend's own post-load step (``convert_to_unquantized_kernel_format``) is plain torch
    for Triton and FlashInfer CUTLASS. No forward pass runs on such a model."""
    if backend is None:
        yield
        return
    try:
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
        from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle
    except Exception as error:  # any import failure means the same here: no backend to select
        raise VllmModelUnavailable(f"vLLM's unquantized MoE oracle cannot be imported ({error!r})") from error
    if not hasattr(method, "select_unquantized_moe_backend"):
        raise VllmModelUnavailable("the installed vLLM's UnquantizedFusedMoEMethod no longer asks the oracle")
    member = oracle.UnquantizedMoeBackend[backend]

    def select(moe_config: Any) -> tuple[Any, Any]:
        kernels = oracle.backend_to_kernel_cls(member)  # 0.25.1: one class; 0.31.0: a list, best first
        return member, kernels[0] if isinstance(kernels, list) else kernels

    with _lock:
        saved = method.select_unquantized_moe_backend
        method.select_unquantized_moe_backend = select
        try:
            yield
        finally:
            method.select_unquantized_moe_backend = saved


def _moe_backends(model: Any) -> dict[str, str]:
    backends = {}
    for name, module in model.named_modules():
        backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
        if backend is not None:
            backends[name] = str(getattr(backend, "name", backend))
    return backends


def build_vllm_model(
    model_dir: str | Path,
    moe_backend: str | None = HOPPER_MOE_BACKEND,
    load_format: str = "auto",
    hf_overrides: Mapping[str, Any] | None = None,
) -> VllmModel:
    """vLLM's model class for ``model_dir`` on the CPU in float32, loaded by vLLM's own loader (``load_format``:
    ``auto`` reads the checkpoint, ``dummy`` draws random weights, then ``process_weights_after_loading``), its
    experts on ``moe_backend`` (default: Triton, what vLLM picks on Hopper). ``VllmModelUnavailable`` where vLLM or
    its config for this checkpoint cannot be had here; a failure while building or loading the model is raised as
    it is (a bug to see, not a reason to skip)."""
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
    # vLLM registers its own config classes with transformers while it reads and builds the model: taken out again
    with _lock, cpu_platform(), transformers_config_classes_kept():
        try:
            vllm_config = EngineArgs(
                model=str(model_dir),
                dtype="float32",
                enforce_eager=True,
                load_format=load_format,
                hf_overrides=overrides,
                max_model_len=256,
            ).create_engine_config()
            _one_process_world(vllm_config)
        except Exception as error:  # no config or world for this checkpoint here: say why, once
            raise VllmModelUnavailable(f"vLLM cannot configure {model_dir} on the CPU: {error!r}") from error
        with moe_backend_selected(moe_backend), set_current_vllm_config(vllm_config), torch.device("cpu"):
            model = get_model_loader(vllm_config.load_config).load_model(
                vllm_config=vllm_config, model_config=vllm_config.model_config
            )
    return VllmModel(model=model, vllm_config=vllm_config, moe_backends=_moe_backends(model))
