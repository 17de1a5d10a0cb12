"""Every tensor the colocated engine computes with is right after every level-2 sleep, wake, push and reset.

For each family the plugin supports (Qwen3.5 dense and MoE, Qwen3-VL dense and MoE with deepstack, Qwen2.5-VL), one
fresh process: a small random checkpoint (bf16), TRL's real ``VLLMGeneration`` (colocate + sleep mode, the engine
``enforce_eager=True`` to start in seconds), and the engine's prompt log-probs on a text prompt and on an image prompt
(the text one first after each wake: an image step rewrites, then zeroes, its own deepstack rows). Measured once on
the fresh engine (before TRL's first level-2 sleep), then after each cycle of level-2 sleep, wake, the plugin's push
(``sync_weights``: reload_skip's re-push, which TRL's generate also goes through) and reset (wake_reset):

- ``driver``: the pages as the driver maps them;
- ``nan_pages``: vLLM's ``CuMemAllocator`` wake path patched so that every page it maps for the weights pool is
  filled with 0xFF bytes (NaN in bf16 and fp32) before anything is written: the result cannot depend on the driver;
- ``generate_nan_pages``: the same pages, through TRL's own ``generate`` (reload_skip's re-push, then TRL's call
  of ``llm.generate``, whose text prompt log-probs are recorded);
- ``wake_reset_off_nan_pages``: the contrast, with the wake_reset fix reverted (its deepstack rows hold NaN).

Each cycle's log-probs are compared with the fresh engine's (max |difference|, NaN counted as different). The record
also lists every tensor of the served model that is neither a parameter nor a buffer, whether it lies in the weights
pool, and which ones wake_reset resets. The JSON is rewritten after every family.

    PYTHONPATH=.:$SITE python benchmarks/gpu/every_tensor.py --out every_tensor.json          # GPU, ~3-5 min
    PYTHONPATH=.:$SITE python benchmarks/gpu/every_tensor.py --no-moe --out every_tensor.json # without MoE kernels
    python benchmarks/gpu/every_tensor.py --stand-in --tiny --out every_tensor.json           # CPU dry run

MoE families need vLLM's MoE kernels (bundle d: ``run_issue32.sh moe`` installs them); where they are missing, or
with ``--no-moe``, those families are recorded as skipped. ``--stand-in``: vLLM's real model classes on the CPU as the
engine (``trl_vlm_fixes.selftest.vllm_engine``: its wake fills the pool with NaN, or zeros for ``driver``), tiny
checkpoints; what is checked there is the script.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import QWEN3VL_ROPE, print_result, run_in_fresh_process

FAMILIES = ("qwen3_5", "qwen3_vl", "qwen2_5_vl", "qwen3_5_moe", "qwen3_vl_moe")
CYCLES = ("driver", "nan_pages", "generate_nan_pages", "wake_reset_off_nan_pages")
TEXT = "Every tensor the engine computes with, after every sleep and every push: is it right? " * 3
IMAGE_TEXT = "What is in this picture?"
TOLERANCE = 1e-3  # one engine, one prompt alone: the same kernels (bf16 log-probs that differ do by >= 1e-2)
_nan_pages = [False]  # read by the patched allocator (GPU) at every page it maps


# --- the checkpoint ----------------------------------------------------------------------------------------------


def build_checkpoint(directory: Path, family: str, tiny: bool) -> Path:
    """A random checkpoint of ``family``: the tests' tiny shape (float32) or a small kernel-ready one (bf16), Qwen3-VL
    with 3 deepstack levels as released."""
    from common import build_random_qwen35, build_tiny_vlm

    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    if tiny:
        return build_tiny_vlm(directory, family)
    if family in ("qwen3_5", "qwen3_5_moe"):
        return build_random_qwen35(directory, 512, 4, family=family, experts=8, moe_intermediate=384)
    text: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4}
    vision: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 2, "out_hidden_size": 512}
    if family == "qwen2_5_vl":  # head dim 128 (hidden / heads), Qwen2.5-VL's own M-RoPE sections
        rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
        text.update(num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
    else:
        text.update(num_attention_heads=4, num_key_value_heads=2, head_dim=128, rope_parameters=QWEN3VL_ROPE)
        vision.update(depth=3, deepstack_visual_indexes=[0, 1, 2])
    if family == "qwen3_vl_moe":
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384, norm_topk_prob=True)
    return build_tiny_qwen35_vlm(directory, text=text, vision=vision, dtype="bfloat16", family=family)


# --- the engine: vLLM's (GPU) or its real model classes on the CPU (dry run) -------------------------------------


class Engine:
    """What the script asks of the colocated engine, on the GPU (``vllm.LLM``) or the CPU (``VllmModelLLM``)."""

    def __init__(self, model_dir: Path, stand_in: bool) -> None:
        self.model_dir, self.stand_in = model_dir, stand_in
        self.llm: Any = None
        self.captured: list[Any] = []  # the prompt log-probs of TRL's own llm.generate calls

    def factory(self, fresh: dict[str, Any]) -> Any:
        """``vllm_generation.LLM`` while TRL builds its engine: the real class (eager), measured before TRL's sleep."""

        def build(**kwargs: Any) -> Any:
            if self.stand_in:
                from trl_vlm_fixes.selftest.vllm_engine import VllmModelLLM

                self.llm = VllmModelLLM(**kwargs)
            else:
                from vllm import LLM

                self.llm = LLM(**{**kwargs, "enforce_eager": True, "enable_prefix_caching": False})
            fresh.update(self.measure())
            self._capture_generate()
            return self.llm

        return build

    def _capture_generate(self) -> None:
        generate = self.llm.generate

        def capturing(prompts: Any, *args: Any, **kwargs: Any) -> Any:
            outputs = generate(prompts, *args, **kwargs)
            if self.stand_in:
                self.captured = [_logprobs_of(self.llm.logits[-1][0], prompt["prompt_token_ids"]) for prompt in prompts]
            else:
                self.captured = [_prompt_logprobs(output) for output in outputs]
            return outputs

        self.llm.generate = capturing

    def text_ids(self) -> list[int]:
        from transformers import AutoTokenizer

        return list(AutoTokenizer.from_pretrained(self.model_dir).encode(TEXT))

    def measure(self) -> dict[str, list[float]]:
        """Prompt log-probs: the text prompt alone first, then the image prompt alone."""
        from PIL import Image

        image = Image.new("RGB", (224, 224), (200, 30, 90))
        if self.stand_in:
            from trl_vlm_fixes.selftest.vllm_engine import forward_logits, processed_image_prompt

            served, directory = self.llm.vllm, str(self.model_dir)
            ids = self.text_ids()
            image_ids, vision = processed_image_prompt(directory, IMAGE_TEXT, image)
            return {
                "text": _logprobs_of(forward_logits(served, directory, ids), ids),
                "image": _logprobs_of(forward_logits(served, directory, image_ids, vision), image_ids),
            }
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        image_prompt = (
            "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
            f"{IMAGE_TEXT}<|im_end|>\n<|im_start|>assistant\n"
        )
        text = self.llm.generate([{"prompt_token_ids": self.text_ids()}], params, use_tqdm=False)
        pictured = self.llm.generate(
            [{"prompt": image_prompt, "multi_modal_data": {"image": image}}], params, use_tqdm=False
        )
        return {"text": _prompt_logprobs(text[0]), "image": _prompt_logprobs(pictured[0])}

    def pages(self, nan: bool) -> None:
        """What the next wake maps for the weights pool: NaN pages, or the driver's (the CPU engine: zeros)."""
        if self.stand_in:
            self.llm.WAKE_PAGES = float("nan") if nan else 0.0
        else:
            _nan_pages[0] = nan


def _logprobs_of(logits: Any, ids: list[int]) -> list[float]:
    """The log-prob of every prompt token after the first, from a forward's logits (the CPU engine)."""
    import torch

    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


def _prompt_logprobs(output: Any) -> list[float]:
    """vLLM's prompt log-probs of the prompt's own tokens (the first has none)."""
    ids, entries = output.prompt_token_ids, output.prompt_logprobs
    return [float(entries[i][ids[i]].logprob) for i in range(1, len(ids))]


def patch_allocator_wake() -> None:
    """vLLM's CuMemAllocator maps every page of a woken allocation with ``create_and_map``: after it, each page of the
    weights pool is filled with 0xFF bytes while ``_nan_pages`` is set, before the backup copy (level 1), the buffer
    restore or any push writes anything."""
    import torch
    from vllm.device_allocator import cumem

    original = cumem.create_and_map

    def mapped_as_nan(handle: Any) -> None:
        original(handle)
        allocator = cumem.CuMemAllocator.get_instance()
        data = allocator.pointer_to_data.get(handle[2])
        if _nan_pages[0] and data is not None and data.tag == "weights":
            cumem.libcudart.cudaMemset(ctypes.c_void_p(handle[2]), 0xFF, handle[1])
            torch.cuda.synchronize()

    cumem.create_and_map = mapped_as_nan


def plain_tensor_report(llm: Any) -> list[dict[str, Any]]:
    """Every tensor of the served model that is neither a parameter nor a buffer: in the weights pool? reset?"""
    from trl_vlm_fixes.patches.wake_reset.plain_tensors import read_by_forward, served_model
    from trl_vlm_fixes.selftest.vllm_engine import plain_pool_tensors

    model = served_model(llm)
    if model is None:
        return []
    reset = {plain.name for plain in read_by_forward(model)}
    ranges: list[tuple[int, int]] = []
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        ranges = [
            (pointer, pointer + data.handle[1])
            for pointer, data in CuMemAllocator.get_instance().pointer_to_data.items()
            if data.tag == "weights"
        ]
    except ImportError:  # vLLM's allocator needs its CUDA library: the CPU has no pool
        ranges = []
    report = []
    for name, tensor in plain_pool_tensors(model).items():
        pointer = tensor.data_ptr()
        report.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "in_weights_pool": any(start <= pointer < end for start, end in ranges) if ranges else None,
                "reset_by_wake_reset": name in reset,
            }
        )
    return report


# --- one family, in its own process ------------------------------------------------------------------------------


def compare(fresh: list[float], served: list[float]) -> dict[str, Any]:
    differences = [abs(a - b) if math.isfinite(b) else math.inf for a, b in zip(fresh, served, strict=True)]
    worst = max(differences, default=0.0)
    return {
        "positions": len(differences),
        "nan_positions": sum(not math.isfinite(b) for b in served),
        "max_abs_diff": worst if math.isfinite(worst) else None,
        "equal": math.isfinite(worst) and worst <= TOLERANCE,
        "bitwise": worst == 0.0,
    }


def run_family(family: str, tiny: bool, stand_in: bool) -> dict[str, Any]:
    import importlib

    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import trl_vlm_fixes
    from trl_vlm_fixes.patches.reload_skip import engine_weights

    if not stand_in:
        from common import force_triton_gdn_prefill, prepare_single_process_colocate

        prepare_single_process_colocate()
        trl_vlm_fixes.REGISTRY.import_targets()
        if trl_vlm_fixes.status()["patches"]["gdn_prefill"]["state"] != "applied":
            force_triton_gdn_prefill()
        patch_allocator_wake()
    vllm_generation: Any = importlib.import_module("trl.generation.vllm_generation")
    model_dir = build_checkpoint(Path(tempfile.mkdtemp()) / family, family, tiny)
    dtype = torch.float32 if tiny else torch.bfloat16
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
    model = model if stand_in else model.cuda()
    engine, fresh = Engine(model_dir, stand_in), {}
    saved = {name: getattr(vllm_generation, name) for name in ("LLM", "is_vllm_available")}
    vllm_generation.LLM, vllm_generation.is_vllm_available = engine.factory(fresh), lambda *a, **k: True
    started = time.perf_counter()
    try:
        generation = vllm_generation.VLLMGeneration(
            model=model,
            accelerator=Accelerator(cpu=stand_in),
            processing_class=AutoProcessor.from_pretrained(model_dir),
            mode="colocate",
            enable_sleep_mode=True,
            gpu_memory_utilization=0.25,
            max_model_length=1024,
            max_num_seqs=8,
            max_completion_length=4,
            temperature=1.0,
        )
    finally:
        for name, value in saved.items():
            setattr(vllm_generation, name, value)
    result: dict[str, Any] = {
        "family": family,
        "engine_start_s": round(time.perf_counter() - started, 1),
        "served_model": type(_served(engine.llm)).__name__,
        "plain_tensors": plain_tensor_report(engine.llm),
        "fix_states": {name: patch["state"] for name, patch in trl_vlm_fixes.status()["patches"].items()},
        "cycles": {},
    }
    text_ids = engine.text_ids()
    for cycle in CYCLES:
        fix_off = cycle.startswith("wake_reset_off")
        trl_vlm_fixes.revert("wake_reset") if fix_off else trl_vlm_fixes.apply()
        engine.pages(nan=cycle != "driver")
        t = time.perf_counter()
        if cycle.startswith("generate"):
            generation.generation_kwargs = {"prompt_logprobs": 0}
            generation.generate(prompts=[text_ids], images=None, num_generations=1)  # sleeps at level 2 at its end
            generation.generation_kwargs = {}
            served = {"text": engine.captured[0]}
        else:
            generation.sync_weights()  # wakes the weights (wake_reset resets after it), pushes every parameter
            generation.llm.wake_up(tags=["kv_cache"])
            served = engine.measure()
            generation.llm.sleep(level=2)
            engine_weights(generation).discarded = True  # reload_skip's record of it, as for TRL's own sleep
        result["cycles"][cycle] = {
            "seconds": round(time.perf_counter() - t, 2),
            **{prompt: compare(fresh[prompt], logprobs) for prompt, logprobs in served.items()},
        }
    trl_vlm_fixes.apply()
    result["fresh_finite"] = all(math.isfinite(v) for values in fresh.values() for v in values)
    return result


def _served(llm: Any) -> Any:
    from trl_vlm_fixes.patches.wake_reset.plain_tensors import served_model

    return served_model(llm)


def moe_kernels_missing() -> str | None:
    try:
        import vllm._moe_C_stable_libtorch  # noqa: F401
    except ImportError as error:  # the library, or one it needs, cannot be loaded: no MoE layer runs
        return f"vLLM's MoE kernels are missing ({error!r}): install bundle d (run_issue32.sh moe)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="every_tensor.json")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE families (no MoE kernels)")
    parser.add_argument("--stand-in", action="store_true", help="CPU dry run: vLLM's model classes on the CPU")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny checkpoints (CPU dry runs)")
    parser.add_argument("--timeout", type=int, default=200, help="seconds per family's process")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one family
    args = parser.parse_args()
    if args.one:
        print_result(run_family(args.one, args.tiny, args.stand_in))
        return
    report: dict[str, Any] = {"tolerance": TOLERANCE, "cycles": list(CYCLES), "families": {}}
    flags = ["--tiny"] * args.tiny + ["--stand-in"] * args.stand_in
    for family in args.families.split(","):
        skip = "not run (--no-moe)" if args.no_moe else (None if args.stand_in else moe_kernels_missing())
        if family.endswith("_moe") and skip:
            report["families"][family] = {"skipped": skip}
        else:
            result, run = run_in_fresh_process([__file__, "--one", family, *flags], timeout=args.timeout)
            if result is None:
                tail = run.stderr.splitlines()[-20:] if run is not None else ["timed out"]
                result = {"error": "\n".join(tail)}
            report["families"][family] = result
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(summary_line(family, report["families"][family]), flush=True)


def summary_line(family: str, result: dict[str, Any]) -> str:
    if "cycles" not in result:
        return f"{family:14} {result.get('skipped') or 'FAILED: ' + result.get('error', '')[-300:]}"
    parts = []
    for cycle, record in result["cycles"].items():
        verdicts = ", ".join(f"{p} {'=' if r['equal'] else 'DIFFERS'}" for p, r in record.items() if p != "seconds")
        parts.append(f"{cycle}: {verdicts}")
    resets = [t["name"] for t in result["plain_tensors"] if t["reset_by_wake_reset"]]
    return f"{family:14} start {result['engine_start_s']} s; " + "; ".join(parts) + f"; reset: {resets or 'none'}"


if __name__ == "__main__":
    main()
