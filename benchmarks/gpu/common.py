"""Shared set-up for the GPU benchmarks: a random Qwen3.5 VLM (dense or MoE) built offline, vLLM 0.25.1 quirks on
Hopper, TRL's GRPO trainer on the mixed image batch, recorders of which weights each rollout ran on (``lm_head``, or
every engine tensor mapped to the trainer's, experts included) and of the prompt ids vLLM sampled from, and one engine
per fresh process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
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
# Qwen3-VL's (head dim 128, the whole head rotated)
QWEN3VL_ROPE = {
    "rope_type": "default",
    "rope_theta": 5000000.0,
    "mrope_section": [24, 20, 20],
    "mrope_interleaved": True,
}


def build_random_qwen35(
    directory: str | Path,
    hidden: int,
    layers: int,
    seed: int = 0,
    *,
    family: str = "qwen3_5",
    experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate: int = 0,
) -> Path:
    """A random Qwen3.5 VLM with the real 3:1 linear/full attention layout, head dims vLLM's kernels accept.

    ``family="qwen3_5_moe"``: the same stack with a sparse MoE block in every layer (``experts`` experts,
    ``experts_per_token`` routed per token, expert width ``moe_intermediate``, and a shared expert of that width);
    ``"qwen3_vl_moe"``: Qwen3-VL MoE (full attention only, head dim 128). transformers 5 keeps the experts fused
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); pick ``moe_intermediate`` with 2I != H
    so that a transposed layout cannot pass for the right one."""
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm, qwen35_layer_stack

    heads = max(2, hidden // 128)
    text: dict[str, Any] = {"hidden_size": hidden, "intermediate_size": hidden * 3, "num_hidden_layers": layers}
    if family == "qwen3_vl_moe":
        text.update(num_attention_heads=heads, num_key_value_heads=2, head_dim=128, rope_parameters=QWEN3VL_ROPE)
    else:
        text.update(qwen35_layer_stack(layers, heads, head_dim=256, value_heads=heads * 2), rope_parameters=QWEN35_ROPE)
    if family.endswith("_moe"):
        width = moe_intermediate or hidden * 3 // 4
        text.update(num_experts=experts, num_experts_per_tok=experts_per_token, moe_intermediate_size=width)
        if family == "qwen3_5_moe":
            text["shared_expert_intermediate_size"] = width
        else:  # vLLM 0.25.1 reads it; transformers 5 always renormalises the top-k and no longer writes it
            text["norm_topk_prob"] = True
    vision = {"hidden_size": 128, "intermediate_size": 256, "out_hidden_size": hidden}
    return build_tiny_qwen35_vlm(directory, seed, text=text, vision=vision, dtype="bfloat16", family=family)


def build_tiny_vlm(
    directory: str | Path,
    family: str = "qwen3_5",
    moe_intermediate: int = 24,
    seed: int = 0,
    sharpness: float = 1.0,
    placeholder_scale: float = 1.0,
) -> Path:
    """The tests' tiny shape (text hidden 32, one Gated-DeltaNet and one full-attention layer for Qwen3.5; MoE: 4
    experts, 2 per token, expert width ``moe_intermediate``, 2I != hidden), float32: for the scripts' CPU dry runs,
    where the stand-in decodes with the model itself (seconds instead of minutes). ``sharpness`` 20 with
    ``placeholder_scale`` 0: a peaked next-token distribution (logits of std ~2, as a trained model's and as the
    1.2B random model's at hidden 2048), where top-k/top-p cut at a clear boundary; at hidden 32 the random model's
    distribution is nearly uniform, and top_p=0.95 over 20 near-equal tokens cuts at a tie."""
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    text: dict[str, Any] = {}
    if family.endswith("_moe"):
        text["moe_intermediate_size"] = moe_intermediate
        if family == "qwen3_5_moe":
            text["shared_expert_intermediate_size"] = moe_intermediate
        else:
            text["norm_topk_prob"] = True
    return build_tiny_qwen35_vlm(
        directory, seed, text=text, family=family, sharpness=sharpness, placeholder_scale=placeholder_scale
    )


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
    except subprocess.TimeoutExpired as expired:
        print_output_tail(expired, f"the last lines it wrote in {timeout} s (cold start or hang: they tell)")
        return None, None
    lines = [line for line in run.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return (json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None), run


def print_output_tail(expired: subprocess.TimeoutExpired, heading: str, lines: int = 40) -> None:
    """What a killed child wrote last (vLLM logs its compile and graph-capture progress with times)."""
    written = []
    for part in (expired.stdout, expired.stderr):
        if part:
            written += (part.decode(errors="replace") if isinstance(part, bytes) else part).splitlines()
    print(f"--- {heading} ---\n" + "\n".join(line[:300] for line in written[-lines:]), flush=True)


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if "Error" in line or "error" in line]


def variant_in_fresh_process(
    script: str, variant: str, arguments: list[str], switches: dict[str, str], timeout: float | None
) -> tuple[dict[str, Any] | None, subprocess.CompletedProcess | None, str | None]:
    """One variant of ``script`` in a fresh process (its own engine), with only its own plugin switches set:
    (its result, the process, why it has no result)."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("TRL_VLM_FIXES")}
    environment.update(switches)
    result, run = run_in_fresh_process([script, "--one", variant, *arguments], timeout=timeout, env=environment)
    if run is None:
        print(f"{variant}: timed out after {timeout} s", flush=True)
        return None, None, f"no result within {timeout} s (hang?)"
    if result is None:
        print(f"{variant}: failed (exit {run.returncode})\n" + "\n".join(run.stderr.splitlines()[-25:]), flush=True)
        return None, run, "\n".join(error_lines(run)[-5:]) or f"exit {run.returncode}"
    return result, run, None


# --- TRL's GRPO trainer on the mixed image batch, with the colocated engine (real, or the CPU stand-in) -------------


def use_engine(stand_in: bool) -> None:
    """Before the trainer is built: the CPU stand-in in place of ``vllm.LLM``, or the real engine's set-up (torch
    distributed variables for the in-process engine; Triton GDN prefill where the plugin's gdn_prefill does not act)."""
    import trl_vlm_fixes

    if stand_in:
        import trl.generation.vllm_generation as vllm_generation

        from trl_vlm_fixes.selftest.engine_standin import StandInLLM

        setattr(vllm_generation, "LLM", StandInLLM)  # noqa: B010 - vllm_generation.LLM is typed as the real class
        return
    prepare_single_process_colocate()
    if os.environ.get("ENGINE_EAGER") == "1":  # no torch.compile or graph capture: starts in seconds (device time)
        import functools

        import trl.generation.vllm_generation as vllm_generation
        from vllm import LLM

        setattr(vllm_generation, "LLM", functools.partial(LLM, enforce_eager=True))  # noqa: B010 - as above
    trl_vlm_fixes.REGISTRY.import_targets()
    if trl_vlm_fixes.status()["patches"]["gdn_prefill"]["state"] != "applied":
        force_triton_gdn_prefill()  # the bundles lack FlashInfer; with the plugin, gdn_prefill picks Triton itself


def varied_reward(completions: list[Any], **_: Any) -> list[float | None]:
    """Any two different completions score differently, so every group has a non-zero advantage and the weights move."""
    return [(sum(ord(c) for c in str(completion)) % 997) / 997 for completion in completions]


def build_grpo_trainer(
    model_dir: Path,
    output_dir: str,
    steps: int,
    stand_in: bool,
    generation_kwargs: dict[str, Any] | None = None,
    max_completion_length: int = 16,
) -> Any:
    """TRL's GRPOTrainer, colocate + sleep mode, on the four mixed samples (four image sizes, four prompt lengths in
    every batch), ``gradient_accumulation_steps=2 > steps_per_generation=1``: two rollouts per optimizer step, the
    second without TRL's sync."""
    import torch
    from transformers import AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, mixed_dataset

    processor = AutoProcessor.from_pretrained(model_dir)
    on_gpu = torch.cuda.is_available() and not stand_in
    config = GRPOConfig(
        output_dir=output_dir,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=1024,
        per_device_train_batch_size=8,  # 4 prompts x 2 generations: every batch holds all four mixed samples
        num_generations=2,
        gradient_accumulation_steps=2,
        steps_per_generation=1,  # < gradient_accumulation_steps: a second rollout per step, without TRL's sync
        max_completion_length=max_completion_length,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        model_init_kwargs={"dtype": "bfloat16" if on_gpu else "float32"},
        generation_kwargs=generation_kwargs or None,
        # no ban of its own on vision placeholder tokens: the plugin's vision_token_guard does it
    )
    return GRPOTrainer(
        model=str(model_dir),
        reward_funcs=varied_reward,
        args=config,
        train_dataset=mixed_dataset(MIXED_SAMPLES * 4),  # 4 micro-batches an epoch: 2 full steps
        processing_class=processor,
    )


def fix_states() -> dict[str, str]:
    import trl_vlm_fixes

    return {name: patch["state"] for name, patch in trl_vlm_fixes.status()["patches"].items()}


class PromptParityRecorder:
    """Wraps the trainer's ``VLLMGeneration.generate`` (outermost, every fix inside): the trainer's prompt ids in,
    the prompt ids vLLM reports out, compared row for row, and the generate's wall time."""

    def __init__(self, generation: Any, image_pad_id: int | None, tags: Any) -> None:
        self.generate, self.image_pad_id, self.tags = generation.generate, image_pad_id, tags
        self.rollouts: list[dict[str, Any]] = []
        generation.generate = self._recording

    def _recording(self, prompts: Any, images: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = self.generate(prompts, images, *args, **kwargs)
        seconds = time.perf_counter() - started
        engine_ids = result[0]
        pads = [
            (list(ids).count(self.image_pad_id), list(e).count(self.image_pad_id))
            for ids, e in zip(prompts, engine_ids, strict=True)
        ]
        self.rollouts.append(
            {
                **self.tags(),
                "rows": len(prompts),
                "identical_rows": sum(list(a) == list(b) for a, b in zip(prompts, engine_ids, strict=True)),
                "image_pads_trainer_vs_engine": pads,
                "generate_s": round(seconds, 4),
            }
        )
        return result


# --- every engine tensor against the trainer's (experts included) --------------------------------------------------

# vLLM stacks some HF projections into one parameter (rows in this order; tensor parallel size 1)
PACKED_PARAMETERS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),  # dense MLP and Qwen3.5 MoE's shared expert
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),  # Qwen3.5 Gated-DeltaNet
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
_PACKED = re.compile(r"^(?P<module>.*)\.(?P<packed>" + "|".join(PACKED_PARAMETERS) + r")\.(?P<kind>weight|bias)$")
# vLLM's fused-MoE parameters under transformers 5's fused expert names ([E, 2I, H] gate then up; [E, H, I])
_EXPERT_NAMES = (
    (re.compile(r"experts\.(?:routed_experts\.)?w13_weight$"), "experts.gate_up_proj"),
    (re.compile(r"experts\.(?:routed_experts\.)?w2_weight$"), "experts.down_proj"),
)
_PREFIXES = (  # (HF or vLLM prefix, canonical prefix)
    ("model.language_model.", "text."),  # HF VLM (the trainer, TRL's pushed names, the stand-in's weights)
    ("language_model.model.", "text."),  # vLLM VLM
    ("model.visual.", "visual."),
    ("language_model.lm_head.", "lm_head."),
    ("model.", "text."),  # HF text-only
)
BF16_HALF_ULP = 2.0**-8  # rounding to bf16 moves a value by at most this share of its magnitude


def engine_named_parameters(engine: Any) -> dict[str, Any]:
    """The tensors the engine generates with, under its own names: the stand-in's ``weights`` (HF names, as TRL
    pushes them), or the real in-process engine's model (vLLM 0.25.1 colocate, one process)."""
    if hasattr(engine, "weights"):
        return dict(engine.weights)
    model = engine.llm_engine.model_executor.driver_worker.model_runner.model
    return dict(model.named_parameters())


def canonical_name(name: str) -> str:
    """One name for a tensor whether HF (trainer, stand-in) or vLLM calls it."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    for prefix, canonical in _PREFIXES:
        if name.startswith(prefix):
            name = canonical + name[len(prefix) :]
            break
    for pattern, replacement in _EXPERT_NAMES:
        name = pattern.sub(replacement, name)
    return name


def is_expert_tensor(name: str) -> bool:
    """A routed expert's fused tensor (not the router, not Qwen3.5 MoE's shared expert)."""
    return canonical_name(name).endswith(("experts.gate_up_proj", "experts.down_proj"))


def _fit(expected: Any, served: Any) -> tuple[Any, Any, str] | None:
    """(expected, served, layout) in comparable shapes, or None when the shapes cannot be the same tensor."""
    if expected.shape == served.shape:
        return expected, served, "same"
    if (
        expected.dim() == served.dim()
        and expected.shape[1:] == served.shape[1:]
        and served.shape[0] > expected.shape[0]
    ):
        return expected, served[: expected.shape[0]], "padded rows"  # vLLM pads the vocabulary
    if expected.dim() >= 2 and expected.transpose(-1, -2).shape == served.shape:
        return expected.transpose(-1, -2), served, "transposed"
    if expected.numel() == served.numel():
        return expected.reshape(served.shape), served, "reshaped"
    return None


def _joined(source: dict[str, Any], names: list[str], device: Any) -> Any:
    """The trainer's tensor(s) an engine tensor stands for, rows concatenated as vLLM stacks them."""
    import torch

    tensors = [source[name].detach().to(device) for name in names]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _difference(expected: Any, served: Any) -> tuple[bool, bool, float]:
    """(exact in the engine's dtype, within bf16 rounding of the trainer's value, max absolute difference)."""
    import torch

    expected = expected.detach().to(served.device)
    exact = bool(torch.equal(expected.to(served.dtype), served))
    reference, value = expected.to(torch.float32), served.detach().to(torch.float32)
    difference = (value - reference).abs()
    within = bool((difference <= reference.abs() * BF16_HALF_ULP).all())
    return exact, within, float(difference.max()) if difference.numel() else 0.0


def compare_engine_weights(
    trainer: dict[str, Any], engine: dict[str, Any], original: dict[str, Any] | None = None, listed: int = 6
) -> dict[str, Any]:
    """Every engine tensor against the trainer's tensor(s) it stands for: same name after the HF/vLLM prefixes, vLLM's
    fused-MoE names (``w13_weight`` = ``experts.gate_up_proj``, ``w2_weight`` = ``experts.down_proj``), vLLM's
    stacked projections (rows concatenated), its padded vocabulary (rows sliced). A w13 that matches only with gate
    and up swapped is reported as such (FlashInfer's CUTLASS/TRTLLM MoE backends rearrange it). ``original``: the
    trainer's tensors before training, to say whether the engine still serves them."""
    import torch

    by_name = {canonical_name(name): tensor for name, tensor in trainer.items()}
    original_by_name = {canonical_name(name): tensor for name, tensor in (original or {}).items()}
    used: set[str] = set()
    unmapped_engine, unfit, rows = [], [], []
    for engine_name, served in engine.items():
        name = canonical_name(engine_name)
        parts: list[str] | None = [name] if name in by_name else None
        packed = _PACKED.match(name) if parts is None else None
        if packed:
            candidates = [f"{packed['module']}.{part}.{packed['kind']}" for part in PACKED_PARAMETERS[packed["packed"]]]
            parts = candidates if all(part in by_name for part in candidates) else None
        if parts is None:
            unmapped_engine.append(engine_name)
            continue
        used.update(parts)
        fitted = _fit(_joined(by_name, parts, served.device), served.detach())
        if fitted is None:
            unfit.append(
                f"{engine_name}: engine {tuple(served.shape)} vs trainer {[tuple(by_name[p].shape) for p in parts]}"
            )
            continue
        expected, value, layout = fitted
        exact, within, max_abs = _difference(expected, value)
        if not within and layout == "same" and is_expert_tensor(name) and name.endswith("gate_up_proj"):
            half = value.shape[1] // 2
            swapped = torch.cat([value[:, half:], value[:, :half]], dim=1)
            if _difference(expected, swapped)[1]:
                value, layout = swapped, "gate/up swapped"
                exact, within, max_abs = _difference(expected, value)
        on_original = None
        if original_by_name and all(part in original_by_name for part in parts):
            reference = _fit(_joined(original_by_name, parts, served.device), served.detach())
            on_original = bool(reference is not None and torch.equal(reference[0].to(value.dtype), reference[1]))
        rows.append(
            {
                "engine": engine_name,
                "trainer": parts,
                "expert": is_expert_tensor(name),
                "layout": layout,
                "exact": exact,
                "within_bf16": within,
                "max_abs_diff": max_abs,
                "on_original": on_original,
                "trainer_moved": None
                if on_original is None
                else not all(torch.equal(by_name[p], original_by_name[p].to(by_name[p].device)) for p in parts),
            }
        )
    experts = [row for row in rows if row["expert"]]
    layouts: dict[str, int] = {}
    for row in rows:
        layouts[row["layout"]] = layouts.get(row["layout"], 0) + 1
    return {
        "tensors_compared": len(rows),
        "tensors_within_bf16": sum(row["within_bf16"] for row in rows),
        "tensors_exact": sum(row["exact"] for row in rows),
        "expert_tensors_compared": len(experts),
        "expert_tensors_within_bf16": sum(row["within_bf16"] for row in experts),
        "expert_layouts": sorted({row["layout"] for row in experts}),
        "expert_tensors_on_original": sum(bool(row["on_original"]) for row in experts),
        "expert_tensors_moved_in_trainer": sum(bool(row["trainer_moved"]) for row in experts),
        "max_abs_diff": max((row["max_abs_diff"] for row in rows), default=0.0),
        "layouts": layouts,
        "differing": [
            f"{row['engine']} ({row['layout']}, max {row['max_abs_diff']:.3g})"
            for row in rows
            if not row["within_bf16"]
        ][:listed],
        "unfit": unfit[:listed],
        "unmapped_engine": unmapped_engine[:listed],
        "unmapped_engine_count": len(unmapped_engine),
        "unmapped_trainer": sorted(set(by_name) - used)[:listed],
        "unmapped_trainer_count": len(set(by_name) - used),
    }


class EngineWeightsRecorder:
    """Wraps a colocated engine's ``generate``: during every rollout (so after every push, TRL's sync or the plugin's
    re-push), every engine tensor is compared with the trainer's current one (``compare_engine_weights``)."""

    def __init__(self, engine: Any, model: Any, tags: Any = None) -> None:
        self.engine, self.model, self.tags = engine, model, tags
        self.original = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.rollouts: list[dict[str, Any]] = []
        self._generate = engine.generate
        engine.generate = self._recording

    def _recording(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            trainer = {name: p.detach() for name, p in self.model.named_parameters()}
            compared = compare_engine_weights(trainer, engine_named_parameters(self.engine), self.original)
        self.rollouts.append({**(self.tags() if self.tags else {}), **compared})
        return self._generate(*args, **kwargs)
