"""Decode at the size users run: a Qwen3.5-shaped 8.95B engine with random weights, per CUDA-graph mode and token ban.

vLLM 0.25.1 builds it from a ``config.json`` alone (``load_format="dummy"``), text-only (``limit_mm_per_prompt`` 0),
with the arguments TRL 1.9.1's colocate mode passes (``external_launcher``, ``max_num_batched_tokens=4096``,
``logprobs_mode="processed_logprobs"``) and Triton GDN prefill. 128 requests, 512-token prompts, 512 sampled tokens
(temperature 1, ``ignore_eos``, ``logprobs=0`` as TRL asks), median of ``--repeats``; the ban variants run interleaved
in one engine: none, ``bad_words`` with the 5 vision placeholders (what vision_token_guard sent before), and
``logit_bias`` of -inf on the same ids. Each mode runs in a fresh process.

It also shows where the Gated-DeltaNet kernels run: ``QwenGatedDeltaNetAttention._forward_core`` (conv1d + recurrent
attention: every GDN kernel of prefill and decode, behind the ``vllm::qwen_gdn_attention_core`` op) is counted while
CUDA graphs are captured and per engine step afterwards. A kernel launched from Python at every step and never during
a capture runs outside every graph (PIECEWISE, NONE); one that is captured is replayed from a graph without Python.
    PYTHONPATH=.:$SITE python benchmarks/gpu/realistic_decode.py --modes FULL_AND_PIECEWISE,PIECEWISE --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import QWEN35_ROPE, error_lines, print_result, run_in_fresh_process

PLACEHOLDERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|endoftext|>")
SHAPE_9B: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(32)],
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "vocab_size": 248320,
    "max_position_embeddings": 4096,
    "rope_parameters": QWEN35_ROPE,
}


def write_config_only_checkpoint(directory: Path) -> Path:
    """config.json (8.95B Qwen3.5 shape) and the tiny processor files: nothing else is needed for dummy weights."""
    from trl_vlm_fixes.selftest.tiny_model import SPECIAL_TOKENS, build_config, build_processor

    processor = build_processor("qwen3_5")
    token_ids = {token: processor.tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    vision = {"hidden_size": 128, "intermediate_size": 256, "out_hidden_size": SHAPE_9B["hidden_size"]}
    config = build_config(SHAPE_9B["vocab_size"], token_ids, SHAPE_9B, vision, "qwen3_5")
    config.dtype = "bfloat16"
    config.architectures = ["Qwen3_5ForConditionalGeneration"]  # without it vLLM resolves a pooling model
    config.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


class GdnProbe:
    """Counts ``_forward_core`` calls of the GDN layers: during graph capture, and per executed engine step."""

    def __init__(self) -> None:
        import torch
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

        self.calls = 0
        self.calls_while_capturing = 0
        original = QwenGatedDeltaNetAttention._forward_core

        def counted(layer: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.calls_while_capturing += bool(torch.cuda.is_current_stream_capturing())
            return original(layer, *args, **kwargs)

        QwenGatedDeltaNetAttention._forward_core = counted  # type: ignore[method-assign]


def count_steps(llm: Any) -> list[int]:
    """Counts the model runner's executed steps (one forward pass of the batch each)."""
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    steps = [0]
    original = runner.execute_model

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps[0] += 1
        return original(*args, **kwargs)

    runner.execute_model = counted
    return steps


def measure(mode: str, model_dir: str, requests: int, repeats: int) -> dict[str, Any]:
    """One engine in this process: the GDN probe, then each ban variant interleaved, ``repeats`` times."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core, as in TRL's colocate mode
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", "29561")
    from common import force_triton_gdn_prefill
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    force_triton_gdn_prefill()
    probe = GdnProbe()
    started = time.perf_counter()
    llm = LLM(
        model=model_dir,
        load_format="dummy",
        dtype="bfloat16",
        gpu_memory_utilization=0.6,
        max_model_len=1088,
        max_num_seqs=requests,
        distributed_executor_backend="external_launcher",
        seed=0,
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
        gdn_prefill_backend="triton",
        limit_mm_per_prompt={"image": 0, "video": 0},
        compilation_config={"cudagraph_mode": mode},
    )
    result: dict[str, Any] = {"mode": mode, "engine_start_s": round(time.perf_counter() - started, 1)}
    config = llm.llm_engine.vllm_config.compilation_config
    result["cudagraph_mode_resolved"] = str(getattr(config.cudagraph_mode, "name", config.cudagraph_mode))
    result["splitting_ops"] = list(config.splitting_ops or [])
    result["gdn_calls_while_capturing"] = probe.calls_while_capturing
    gdn_layers = sum(1 for t in SHAPE_9B["layer_types"] if t == "linear_attention")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    banned = [tokenizer.convert_tokens_to_ids(token) for token in PLACEHOLDERS]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 250 + 3 for j in range(512)]} for i in range(requests)]
    common = {"temperature": 1.0, "max_tokens": 512, "ignore_eos": True, "logprobs": 0}
    variants = {
        "no_ban": SamplingParams(**common),
        "bad_words": SamplingParams(**common, bad_words=list(PLACEHOLDERS)),
        "logit_bias_-inf": SamplingParams(**common, logit_bias=dict.fromkeys(banned, float("-inf"))),
    }
    steps = count_steps(llm)
    llm.generate(prompts[:8], variants["no_ban"], use_tqdm=False)  # warm-up
    probe.calls, steps[0] = 0, 0
    t = time.perf_counter()
    outputs = llm.generate(prompts, variants["no_ban"], use_tqdm=False)
    elapsed = time.perf_counter() - t
    result["probe"] = {
        "engine_steps": steps[0],
        "gdn_forward_core_calls": probe.calls,
        "gdn_layers": gdn_layers,
        "calls_per_step_per_gdn_layer": round(probe.calls / max(1, steps[0] * gdn_layers), 3),
        "gdn_calls_while_capturing_after_warmup": probe.calls_while_capturing - result["gdn_calls_while_capturing"],
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    rates["no_ban"].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    sampled_banned: dict[str, int] = dict.fromkeys(variants, 0)
    for repeat in range(repeats):
        for name, params in variants.items():
            if name == "no_ban" and repeat == 0:
                continue  # the probe's run was the first no-ban measurement
            t = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
            sampled_banned[name] += sum(t in banned for o in outputs for t in o.outputs[0].token_ids)
        print(json.dumps({"mode": mode, "repeat": repeat, **{k: [round(r) for r in v] for k, v in rates.items()}}))
    result["tok_s"] = {name: round(statistics.median(values)) for name, values in rates.items() if values}
    result["tok_s_all"] = {name: [round(v) for v in values] for name, values in rates.items()}
    result["banned_tokens_sampled"] = sampled_banned
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="FULL_AND_PIECEWISE,PIECEWISE,NONE")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=560, help="seconds per mode")
    parser.add_argument("--out", default="realistic_decode.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print_result(measure(args.one, args.model_dir, args.requests, args.repeats))
        return
    from common import versions

    model_dir = write_config_only_checkpoint(Path(tempfile.mkdtemp()) / "qwen35-9b-shape")
    report: dict[str, Any] = {"versions": versions(), "requests": args.requests, "results": []}
    for mode in args.modes.split(","):
        command = [__file__, "--one", mode, "--model-dir", str(model_dir)]
        command += ["--requests", str(args.requests), "--repeats", str(args.repeats)]
        result, run = run_in_fresh_process(command, timeout=args.timeout)
        if result is None:
            tail = "\n".join(error_lines(run)[-15:]) if run else f"timed out after {args.timeout} s"
            print(f"{mode}: failed\n{tail}", flush=True)
            report["results"].append({"mode": mode, "error": tail[-2000:]})
        else:
            report["results"].append(result)
            print(json.dumps(result), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    measured = [r for r in report["results"] if "tok_s" in r]
    default = next((r["tok_s"]["no_ban"] for r in measured if r["mode"] == "FULL_AND_PIECEWISE"), None)
    header = f"{'mode':<20}{'no ban':>10}{'bad_words':>11}{'logit_bias':>12}{'vs default':>12}"
    print(header + f"{'GDN calls/step/layer':>22}")
    for r in measured:
        rates = r["tok_s"]
        ratio = f"{rates['no_ban'] / default:.2f}x" if default else "-"
        bans = f"{rates.get('bad_words', '-'):>11}{rates.get('logit_bias_-inf', '-'):>12}"
        print(f"{r['mode']:<20}{rates['no_ban']:>10}{bans}{ratio:>12}{r['probe']['calls_per_step_per_gdn_layer']:>22}")


if __name__ == "__main__":
    main()
