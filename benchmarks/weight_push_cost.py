"""weight_buckets' gain: the time of one colocated weight push, per parameter (TRL 1.9.1) vs in buckets, in one run.

    python benchmarks/weight_push_cost.py [--layers 24] [--hidden 64] [--family qwen3_5] [--repeat 5]
TRL's real ``VLLMGeneration.sync_weights`` pushes a random Qwen3.5 VLM into vLLM's real model class built on the CPU
(``selftest/vllm_model``, float32): the engine's ``load_weights`` exactly as a colocated engine runs it, every call
walking vLLM's ``AutoWeightsLoader``. The layer count is a 2B-class Qwen3.5's (24: 18 Gated-DeltaNet, 6 full
attention) and the widths are small, so what is timed is mostly the per-call cost the buckets remove (the loader's
walk, the name mapping, one call per tensor) and little of the copies, which are the same either way; on a GPU the
copies are faster still, so the share of the calls is larger there. The engine's parameters after both pushes are
compared bit for bit. Best of ``--repeat`` pushes each way; the ratio is per-parameter time / bucketed time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import best_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24: a 2B-class Qwen3.5)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the decoder")
    parser.add_argument("--family", default="qwen3_5", help="qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe, qwen2_5_vl")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import torch
    from transformers import AutoProcessor

    import trl_vlm_fixes
    from trl_vlm_fixes.patches.weight_buckets import DEFAULT_BUCKET_MB, aside_reason
    from trl_vlm_fixes.selftest.checks.weight_buckets import push_setup
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm, sized_text
    from trl_vlm_fixes.selftest.vllm_model import cpu_platform, release_world

    torch.set_num_threads(1)
    text = sized_text(args.layers, args.hidden, args.family)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_tiny_qwen35_vlm(scratch, text=text, family=args.family)
        setup = push_setup(model_dir, AutoProcessor.from_pretrained(model_dir))
        parameters = sum(1 for _ in setup.generation.model.parameters())
        megabytes = sum(p.numel() * p.element_size() for p in setup.generation.model.parameters()) / 2**20
        results = {}
        for label, on in (("per parameter (fix off)", False), ("in buckets (fix on)", True)):
            trl_vlm_fixes.revert()
            if on:
                trl_vlm_fixes.apply()
            if on and (reason := aside_reason(setup.generation)):
                print(f"weight_buckets steps aside on this TRL: {reason}")
                return
            pushed = setup.push()  # warm-up, and the engine's weights after it (NaN before it)
            with cpu_platform():
                seconds = best_of(setup.generation.sync_weights, args.repeat)  # the push alone
            results[label] = (seconds, pushed)
        trl_vlm_fixes.apply()
        release_world()
    (off_seconds, off), (on_seconds, on_pushed) = results.values()
    assert on_pushed.mismatches(off) == [], "the bucketed push left other weights than TRL's"
    print(
        f"{args.family}, {args.layers} layers, hidden {args.hidden}: {parameters} parameters, {megabytes:.1f} MiB "
        f"(float32), buckets of {DEFAULT_BUCKET_MB:g} MiB; engine weights bit-identical after both pushes"
    )
    print(f"{'':26}{'load_weights calls':>20}{'gathers':>10}{'push (ms)':>12}")
    for label, (seconds, pushed) in results.items():
        print(f"{label:26}{len(pushed.calls):>20}{pushed.gathers:>10}{seconds * 1e3:>12.1f}")
    print(f"ratio per-parameter / bucketed: {off_seconds / on_seconds:.1f}x")


if __name__ == "__main__":
    main()
