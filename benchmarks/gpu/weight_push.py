"""weight_buckets on the GPU: TRL's colocated weight push, per parameter (TRL 1.9.1) vs in buckets, in one process.

TRL's real ``VLLMGeneration`` in colocate + sleep mode on the real vLLM engine (one engine start), the trainer's model
in bf16 on the same GPU, a random Qwen3.5 VLM of the given size (``common.build_random_qwen35``):
    --hidden 2048 --layers 24   2B-class (the default)
    --hidden 4096 --layers 32   9B-class (one engine start; meant to fit a 10-minute call, checkpoint build included)
TRL's ``sync_weights`` is timed with the fix off, then on, in the same process: ``TRL_VLM_FIXES_WEIGHT_BUCKETS=0``
/ ``1`` then ``trl_vlm_fixes.revert(); trl_vlm_fixes.apply()`` (every other fix stays as the environment says). Each
push starts as in training, from an engine asleep at level 2 (TRL's sleep after every generate; its ``wake_up`` of
the weights is inside the push, the same both ways); CUDA is synchronized around each. Per variant: one warm-up push,
``--repeat`` timed pushes (best and median), then one more untimed push into an engine whose every parameter was set
to NaN right after the weights woke (a parameter no push reaches stays NaN), after which every engine parameter and
buffer is read back (``llm.llm_engine.model_executor.driver_worker.model_runner.model``) and compared bit for bit
between the two variants, and with the trainer's tensors (``common.compare_engine_weights``). ``load_weights`` calls
are counted by wrapping the engine model's ``load_weights``. The trainer's weights are moved once by a random step,
so the engine holds other values than the checkpoint it loaded.
    PYTHONPATH=.:$SITE python benchmarks/gpu/weight_push.py --hidden 2048 --layers 24 --out weight_push_2b.json
    PYTHONPATH=.:$SITE python benchmarks/gpu/weight_push.py --hidden 4096 --layers 32 --out weight_push_9b.json
The engine is built with ``enforce_eager=True`` (``ENGINE_EAGER=1``: no torch.compile, no graph capture; the push
does not run the model) unless ``--compile``; ``--load-format dummy`` lets vLLM skip reading the checkpoint (every
parameter is pushed anyway). ``--stand-in`` swaps the engine for the behavioural stand-in (CPU dry run of the script
itself, no vLLM engine: its weights are a dict under the trainer's names); ``--tiny`` uses the tests' tiny shape.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    build_random_qwen35,
    build_tiny_vlm,
    compare_engine_weights,
    engine_named_parameters,
    fix_states,
    print_result,
    use_engine,
    versions,
)

SWITCH = "TRL_VLM_FIXES_WEIGHT_BUCKETS"
VARIANTS = (("off", "per parameter (fix off)", "0"), ("on", "in buckets (fix on)", "1"))
LISTED = 8  # names listed in the record where tensors differ


class LoadCounter:
    """Wraps the engine model's ``load_weights`` (what TRL and the fix call): calls and tensors since ``clear``."""

    def __init__(self, loader: Any) -> None:
        self.calls = self.tensors = 0
        self._load = loader.load_weights
        loader.load_weights = self._counting

    def clear(self) -> None:
        self.calls = self.tensors = 0

    def _counting(self, weights: Any) -> Any:
        weights = list(weights)
        self.calls += 1
        self.tensors += len(weights)
        return self._load(weights)


def engine_model(engine: Any) -> Any:
    return engine.llm_engine.model_executor.driver_worker.model_runner.model


def engine_tensors(engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(parameters, buffers) the engine serves: the real engine's model, or the stand-in's weights (no buffers)."""
    if hasattr(engine, "weights"):
        return dict(engine.weights), {}
    model = engine_model(engine)
    return dict(model.named_parameters()), dict(model.named_buffers())


def poison(engine: Any) -> int:
    """Every engine parameter NaN (integer ones -1): a parameter the push does not reach is seen afterwards. Returns
    how many were set."""
    import torch

    def filled(tensor: Any) -> Any:
        return tensor.fill_(math.nan if tensor.is_floating_point() else -1)

    with torch.no_grad():
        if hasattr(engine, "weights"):
            engine.weights = {name: filled(tensor.clone()) for name, tensor in engine.weights.items()}
            return len(engine.weights)
        parameters = list(engine_model(engine).parameters())
        for parameter in parameters:
            filled(parameter.data)
        return len(parameters)


def push_into_poisoned_engine(generation: Any, engine: Any) -> int:
    """One ``sync_weights`` whose engine parameters are NaN from the moment its weights wake (inside the push);
    returns how many parameters were set to NaN."""
    wake_up = engine.wake_up
    poisoned: list[int] = []

    def poisoning_wake_up(*args: Any, **kwargs: Any) -> Any:
        result = wake_up(*args, **kwargs)
        tags = args[0] if args else kwargs.get("tags")
        if tags is None or "weights" in tags:
            poisoned.append(poison(engine))
        return result

    engine.wake_up = poisoning_wake_up
    try:
        generation.sync_weights()
    finally:
        del engine.wake_up  # the class's own (and whatever the plugin wraps it with) again
    return sum(poisoned)


def as_bytes(tensor: Any) -> Any:
    import torch

    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def same_bits(reference: Any, tensor: Any) -> bool:
    import torch

    if reference.shape != tensor.shape or reference.dtype != tensor.dtype:
        return False
    return bool(torch.equal(as_bytes(reference).to(tensor.device), as_bytes(tensor)))


def not_finite(tensors: dict[str, Any]) -> list[str]:
    import torch

    return [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def bit_comparison(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    differing = [
        name for name in sorted(set(first) | set(second))
        if name not in first or name not in second or not same_bits(first[name], second[name])
    ]  # fmt: skip
    return {
        "compared": len(set(first) | set(second)),
        "differing_count": len(differing),
        "differing": differing[:LISTED],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="weight_push.json")
    parser.add_argument("--hidden", type=int, default=2048, help="text hidden size (2048: 2B-class, 4096: 9B-class)")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: 2B-class, 32: 9B-class)")
    parser.add_argument("--repeat", type=int, default=5, help="timed pushes per variant")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="the engine's share of the GPU")
    parser.add_argument("--compile", action="store_true", help="vLLM's torch.compile and CUDA graphs (slower start)")
    parser.add_argument("--load-format", default="auto", help="the engine's load_format (dummy: no checkpoint read)")
    parser.add_argument("--stand-in", action="store_true", help="CPU dry run with the behavioural stand-in engine")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny shape (hidden 32; CPU dry runs)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat takes 1 or more")

    os.environ["ENGINE_EAGER"] = "0" if args.compile else "1"
    use_engine(args.stand_in)  # before TRL's module builds an engine: the stand-in, or the real engine's set-up
    import torch
    import trl.generation.vllm_generation as vllm_generation
    from accelerate import Accelerator
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_vlm_fixes.patches.weight_buckets import MIB, aside_reason, bucket_bytes
    from trl_vlm_fixes.selftest.fixtures import fix_switched

    if args.load_format != "auto" and not args.stand_in:
        setattr(vllm_generation, "LLM", functools.partial(vllm_generation.LLM, load_format=args.load_format))  # noqa: B010

    on_cuda = torch.cuda.is_available() and not args.stand_in
    if not on_cuda and not args.stand_in:
        parser.error("the real engine needs a CUDA device (--stand-in for a CPU dry run)")
    device = "cuda" if on_cuda else "cpu"
    scratch = tempfile.TemporaryDirectory()
    started = time.perf_counter()
    if args.tiny:
        args.hidden, args.layers = 32, 2
        model_dir = build_tiny_vlm(Path(scratch.name) / "model")
    else:
        model_dir = build_random_qwen35(Path(scratch.name) / "model", args.hidden, args.layers)
    report: dict[str, Any] = {
        "stand_in": args.stand_in,
        "hidden": args.hidden,
        "layers": args.layers,
        "repeat": args.repeat,
        "engine": "stand-in" if args.stand_in else f"vLLM, enforce_eager={not args.compile}",
        "load_format": args.load_format,
        "model_build_s": round(time.perf_counter() - started, 1),
    }
    if not args.stand_in:
        report["versions"] = versions()

    started = time.perf_counter()
    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    torch.manual_seed(0)
    with torch.no_grad():  # a random step: the trainer's weights differ from the checkpoint the engine loaded
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=1e-2)
    report["trainer_load_s"] = round(time.perf_counter() - started, 1)
    report["parameters"] = sum(1 for _ in model.parameters())
    report["parameter_count"] = sum(p.numel() for p in model.parameters())
    report["trainer_mib"] = round(sum(p.numel() * p.element_size() for p in model.parameters()) / MIB, 1)

    started = time.perf_counter()
    generation = vllm_generation.VLLMGeneration(
        model=model,
        accelerator=Accelerator(cpu=not on_cuda),
        processing_class=processor,
        mode="colocate",
        enable_sleep_mode=True,  # TRL sleeps the engine at level 2 here and after every generate
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_length=512,
        max_num_seqs=8,
        max_completion_length=16,
    )
    report["engine_start_s"] = round(time.perf_counter() - started, 1)
    engine = generation.llm
    counter = LoadCounter(engine_model(engine))

    def synchronize() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    def push() -> float:
        """One push from an engine asleep at level 2, as in training; then TRL's generate-side wake and sleep."""
        counter.clear()
        synchronize()
        t = time.perf_counter()
        generation.sync_weights()
        synchronize()
        seconds = time.perf_counter() - t
        engine.wake_up(tags=["kv_cache"])  # what TRL's generate wakes, then its level-2 sleep after the rollout
        engine.sleep(level=2)
        return seconds

    trainer = {name: p.detach() for name, p in model.named_parameters()}
    snapshot: tuple[dict[str, Any], dict[str, Any]] | None = None
    comparison: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    report["variants"] = results
    for key, label, switch in VARIANTS:
        with fix_switched("weight_buckets", switch == "1"):
            result: dict[str, Any] = {"label": label, SWITCH: switch, "pushes": 0}
            result["fix_state"] = fix_states().get("weight_buckets")
            result["aside_reason"] = aside_reason(generation) if switch == "1" else None
            result["bucket_mb"] = bucket_bytes() / MIB if switch == "1" else None
            results[key] = result
            push()  # warm-up: the first push after the switch (the fix's one-time checks, its log line)
            result["pushes"] += 1
            seconds, calls, tensors = [], set(), set()
            for _ in range(args.repeat):
                seconds.append(push())
                calls.add(counter.calls)
                tensors.add(counter.tensors)
                result["pushes"] += 1
            result.update(
                push_s=[round(s, 6) for s in seconds],
                push_s_best=min(seconds),
                push_s_median=statistics.median(seconds),
                load_weights_calls=max(calls),
                load_weights_calls_every_push=sorted(calls),
                tensors_per_push=max(tensors),
            )
            counter.clear()
            # the variant's last push, read back below
            result["verification_push_poisoned_parameters"] = push_into_poisoned_engine(generation, engine)
            result["pushes"] += 1
            result["verification_push_load_weights_calls"] = counter.calls
            with torch.no_grad():
                parameters, buffers = engine_tensors(engine)
                result["engine_parameters_not_finite"] = not_finite(parameters)[:LISTED]
                result["engine_parameters_not_finite_count"] = len(not_finite(parameters))
                versus = compare_engine_weights(trainer, engine_named_parameters(engine))
                result["engine_vs_trainer"] = {
                    k: versus[k]
                    for k in (
                        "tensors_compared", "tensors_exact", "tensors_within_bf16", "max_abs_diff", "differing",
                        "unfit", "unmapped_engine_count", "unmapped_engine", "unmapped_trainer_count",
                    )
                }  # fmt: skip
                if snapshot is None:
                    snapshot = (
                        {name: t.detach().to("cpu", copy=True) for name, t in parameters.items()},
                        {name: t.detach().to("cpu", copy=True) for name, t in buffers.items()},
                    )
                else:
                    comparison = {
                        "parameters": bit_comparison(snapshot[0], parameters),
                        "buffers": bit_comparison(snapshot[1], buffers),
                    }
            if on_cuda:
                torch.cuda.empty_cache()
            engine.wake_up(tags=["kv_cache"])
            engine.sleep(level=2)
            Path(args.out).write_text(json.dumps(report, indent=2))  # what is done so far outlives a killed call

    off, on = results["off"], results["on"]
    report["ratio_off_on_best"] = off["push_s_best"] / on["push_s_best"]
    report["ratio_off_on_median"] = off["push_s_median"] / on["push_s_median"]
    report["engine_weights"] = {
        **comparison,
        "identical": bool(comparison)
        and comparison["parameters"]["differing_count"] == 0
        and comparison["buffers"]["differing_count"] == 0,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))

    where = "stand-in engine (CPU)" if args.stand_in else report["versions"]["gpu"]
    print(
        f"Qwen3.5 VLM, hidden {args.hidden}, {args.layers} layers: {report['parameters']} parameters, "
        f"{report['parameter_count'] / 1e9:.2f}B, {report['trainer_mib']:.0f} MiB (bf16); {where}; "
        f"engine start {report['engine_start_s']} s; buckets of {on['bucket_mb']:g} MiB"
    )
    print(f"{'variant':26}{'load_weights calls':>20}{'tensors':>10}{'push best (s)':>15}{'push median (s)':>17}")
    for result in results.values():
        print(
            f"{result['label']:26}{result['load_weights_calls']:>20}{result['tensors_per_push']:>10}"
            f"{result['push_s_best']:>15.4f}{result['push_s_median']:>17.4f}"
        )
    print(f"ratio off/on: best {report['ratio_off_on_best']:.2f}x, median {report['ratio_off_on_median']:.2f}x")
    if on["aside_reason"]:
        print(f"weight_buckets stepped aside: {on['aside_reason']}")
    weights = report["engine_weights"]
    print(
        f"engine weights after each variant's last push: "
        f"{'bit-identical' if weights['identical'] else 'DIFFERENT'} ({weights['parameters']['compared']} parameters, "
        f"{weights['parameters']['differing_count']} differ; {weights['buffers']['compared']} buffers, "
        f"{weights['buffers']['differing_count']} differ); engine = trainer: "
        + ", ".join(
            f"{r['label'].split(' (')[0]} {r['engine_vs_trainer']['tensors_exact']}/"
            f"{r['engine_vs_trainer']['tensors_compared']} exact, {r['engine_parameters_not_finite_count']} not finite "
            f"of {r['verification_push_poisoned_parameters']} set to NaN"
            for r in results.values()
        )
    )
    print_result(
        {
            "ratio_off_on_best": report["ratio_off_on_best"],
            "identical": weights["identical"],
            "calls": {key: result["load_weights_calls"] for key, result in results.items()},
        }
    )
    scratch.cleanup()


if __name__ == "__main__":
    main()
