"""Shared set-up for the GPU benchmarks: a random Qwen3.5 VLM built offline, vLLM 0.25.1 quirks on Hopper, a recorder
of which weights each rollout ran on, and one engine per fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULT_PREFIX = "RESULT "


def prepare_single_process_colocate() -> None:
    """TRL's colocate mode runs vLLM in-process (external_launcher): it needs the torch.distributed variables."""
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": os.environ.get("MASTER_PORT", "29555"),
    }.items():
        os.environ.setdefault(key, value)


def engine_additional_config(llm: Any) -> dict[str, Any]:
    """vLLM keeps ``gdn_prefill_backend`` in ``additional_config`` (EngineArgs): what the engine really got."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    extra = getattr(config, "additional_config", None)
    if isinstance(extra, dict):
        return extra
    return dict(getattr(llm, "init_kwargs", {}))  # the CPU stand-in records its arguments instead


def engine_gdn_prefill_kernels(llm: Any) -> list[str]:
    """The prefill kernel each Gated-DeltaNet layer of the in-process engine really uses (``ChunkGatedDeltaRule``)."""
    try:
        model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    except AttributeError:
        return []
    if not hasattr(model, "modules"):  # the CPU stand-in has no layers
        return []
    return sorted({m.gdn_prefill_backend for m in model.modules() if hasattr(m, "gdn_prefill_backend")})


def force_triton_gdn_prefill() -> None:
    """FlashInfer is absent from the offline bundles: vLLM 0.25.1 would pick it for the Gated-DeltaNet prefill."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    qwen_gdn_linear_attn._resolve_gdn_prefill_backend = lambda *args, **kwargs: ("triton", "triton")


# Qwen3.5's real rope settings (the tiny test model's are scaled down): the GPU benchmarks' models use them
QWEN35_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}


def build_random_qwen35(directory: str | Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A random Qwen3.5 VLM with the real 3:1 linear/full attention layout, head dims vLLM's kernels accept."""
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    heads = max(2, hidden // 128)
    text = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": heads,
        "linear_num_value_heads": heads * 2,
        "rope_parameters": QWEN35_ROPE,
    }
    vision = {"hidden_size": 128, "intermediate_size": 256, "out_hidden_size": hidden}
    return build_tiny_qwen35_vlm(directory, seed, text=text, vision=vision, dtype="bfloat16")


def versions() -> dict[str, Any]:
    import torch
    import transformers
    import trl
    import vllm

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "vllm": vllm.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }


def served_lm_head(engine: Any) -> Any:
    """The lm_head the engine generates with (the stand-in keeps a dict; vLLM a model behind its worker)."""
    if hasattr(engine, "weights"):
        return engine.weights["lm_head.weight"]
    model = engine.llm_engine.model_executor.driver_worker.model_runner.model
    return (getattr(model, "lm_head", None) or model.language_model.lm_head).weight


def engine_cudagraph_mode(engine: Any) -> str:
    """What the engine itself was configured with (vLLM resolves the mode into its own config)."""
    config = getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    if config is not None:
        mode = config.compilation_config.cudagraph_mode
        return str(getattr(mode, "name", mode))
    compilation = getattr(engine, "init_kwargs", {}).get("compilation_config")  # the stand-in
    return str((compilation or {}).get("cudagraph_mode", "default"))


class RolloutRecorder:
    """Wraps a colocated engine's ``generate`` and ``collective_rpc``: during every rollout, compares the engine's
    lm_head with the trainer's current one and the original checkpoint, and counts reloads from disk."""

    def __init__(self, engine: Any, trainer_lm_head: Any, tags: Any = None) -> None:
        self.engine, self.trainer_lm_head, self.tags = engine, trainer_lm_head, tags
        self.original = trainer_lm_head.detach().clone()
        self.rollouts: list[dict[str, Any]] = []
        self.disk_reloads = 0
        self._generate, self._collective_rpc = engine.generate, engine.collective_rpc
        engine.generate, engine.collective_rpc = self._recording_generate, self._counting_rpc

    def clear(self) -> None:
        self.rollouts.clear()
        self.disk_reloads = 0

    def _recording_generate(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        trainer = self.trainer_lm_head.detach()
        served = served_lm_head(self.engine)[: trainer.shape[0]].detach()  # vLLM pads the vocabulary
        self.rollouts.append(
            {
                **(self.tags() if self.tags else {}),
                "on_current": bool(torch.equal(served, trainer.to(served.device, served.dtype))),
                "on_original": bool(torch.equal(served, self.original.to(served.device, served.dtype))),
                "all_zero": bool(not served.any()),
                "trainer_moved_from_original": not bool(torch.equal(trainer, self.original)),
            }
        )
        return self._generate(*args, **kwargs)

    def _counting_rpc(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        self.disk_reloads += method == "reload_weights"
        return self._collective_rpc(method, *args, **kwargs)


def print_result(result: dict[str, Any]) -> None:
    """What a child started by ``run_in_fresh_process`` reports back."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_in_fresh_process(
    arguments: list[str], timeout: float | None = None, env: dict[str, str] | None = None
) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess | None]:
    """Run a script in a fresh interpreter (one engine per process) and read its ``print_result`` line.

    Returns (result, process); the result is None when the child printed none, the process None when it timed out."""
    try:
        run = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, None
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return (json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None), run


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if "Error" in line or "error" in line]
