"""sampling_parity's cost beside the scoring pass it joins, at Qwen3.5's vocabulary (248,320; ``--vocabulary 151936``
for Qwen3-VL's), measured in one run.

    python benchmarks/sampling_parity_cost.py [--hidden 1024] [--layers 8] [--rows 4] [--completion 256]
        [--device cuda --dtype bfloat16]   # on a GPU, at a user's size (benchmarks/gpu/run_issue32.sh cost)
        [--before PATH]   # also time the tensor core of another copy of the plugin (git HEAD's), same run: ratios
        [--rule sort]     # on the CPU: vLLM's sort-based top-k/top-p instead of its Triton kernel in Triton's
                          # interpreter (seconds per row at this vocabulary: not a cost a GPU run pays)
The fix adds no forward pass: in the no-gradient scoring pass that gives TRL's ``old_per_token_logps`` it takes the
hidden states that predict each scored token and computes its log-prob under vLLM's processed distribution
(``patches/sampling_parity/processed.py``): with nothing cut or a ban alone, the banned tokens' logits and the
sampled one's (gathers) and the plain log-prob (TRL's own where it is float32, else one float32 log-softmax pass over
the vocabulary: TRL 1.9.1's bf16 logits), a subtraction; with truncation the trainer's own min-p/top-k/top-p over the
vocabulary through vLLM's own functions (its processors, its top-k/top-p: the Triton kernel on a GPU), reading TRL
1.9.1's logits one completion at a time as the fix's hook does, or projecting chunks of positions through the output
layer again (TRL 1.16's fused head never keeps the logits). That work is timed here against the
pass itself (the model's forward over prompt + completion and TRL's ``selective_log_softmax``), on the CPU or a GPU
(``--device cuda``: everything is made there, timings wait for the GPU), with a random Qwen3.5 text stack of the
given size (3:1 Gated-DeltaNet/full attention, the real vocabulary). Both scale
with the number of scored tokens; the pass also with the model's size, so a larger model makes the ratio smaller.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import best_of

VOCABULARY = 248_320  # Qwen3.5's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocabulary", type=int, default=VOCABULARY, help="248,320 (Qwen3.5) or 151,936 (Qwen3-VL)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4, help="completions in one scoring chunk")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: timings then wait for the GPU's work")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--chunk-elements", type=int, default=0, help="the fix's chunk size to try (0: its own)")
    parser.add_argument("--before", default="", help="a plugin checkout whose sampling_parity core is timed too")
    parser.add_argument("--rule", default="engine", choices=("engine", "sort"), help="top-k/top-p rule on the CPU")
    parser.add_argument(
        "--drawn", action="store_true", help="completions drawn at random, not generated (long ones, quickly)"
    )
    parser.add_argument("--cases", default="", help="only the settings whose names start with these (comma-separated)")
    args = parser.parse_args()

    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from trl.trainer.utils import selective_log_softmax

    from trl_vlm_fixes.patches.sampling_parity import processed
    from trl_vlm_fixes.selftest.tiny_model import qwen35_layer_stack

    if args.rule == "sort":
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

        from trl_vlm_fixes.patches.sampling_parity import vllm_rule

        vllm_rule.top_k_top_p = lambda logits, k, p: apply_top_k_top_p_pytorch(logits, k, p)  # type: ignore[assignment]
    cores = {"after": processed}
    if args.before:
        cores["before"] = core_of(args.before)

    if args.chunk_elements:
        processed.CHUNK_ELEMENTS = args.chunk_elements
    torch.manual_seed(0)
    torch.set_default_dtype(getattr(torch, args.dtype))
    if args.device != "cpu":
        torch.set_default_device(args.device)  # the model, the prompts and the fix's work on the GPU
    heads = max(2, args.hidden // 128)
    config = Qwen3_5TextConfig(
        vocab_size=args.vocabulary,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        tie_word_embeddings=False,
        **qwen35_layer_stack(args.layers, heads, head_dim=128, value_heads=heads),
    )
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units: a peaked distribution, as a trained model's
    prompt = torch.randint(0, 1000, (args.rows, args.prompt))
    keep = args.completion
    # completions sampled from the model's own distribution, as vLLM's would be (the ban's cost depends on it)
    if args.drawn:  # the plain log-prob's cost does not depend on which tokens were sampled
        ids = torch.cat([prompt, torch.randint(0, args.vocabulary, (args.rows, keep))], dim=1)
    else:
        ids = model.generate(
            prompt, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=keep, min_new_tokens=keep, pad_token_id=0
        )

    def scoring_pass() -> Any:  # what TRL 1.9.1's _get_per_token_logps_and_entropies does for one chunk
        with torch.no_grad():
            logits = model(input_ids=ids, logits_to_keep=keep + 1, use_cache=False).logits[:, :-1, :]
            return logits, selective_log_softmax(logits, ids[:, -keep:])

    def timed(function: Any) -> float:
        """Best of a few runs; on a GPU, until its queued work is done."""
        if args.device == "cpu":
            return best_of(function)
        function()  # warm-up: kernel compilation and the allocator's first growth are not the steady cost
        return best_of(lambda: (function(), torch.cuda.synchronize()))

    seconds_pass = timed(scoring_pass)
    logits, trl_logps = scoring_pass()
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, -(keep + 1) : -1]
    completion = ids[:, -keep:]
    banned = tuple(range(args.vocabulary - 320, args.vocabulary - 312))
    cases: dict[str, dict[str, Any]] = {
        "nothing cut": {},  # float32 log-probs: a pass over the vocabulary where TRL's logits are bf16
        "ban (8 placeholders)": {"banned": banned},
        "top_k=20, top_p=0.95 + ban": {"top_k": 20, "top_p": 0.95, "banned": banned},
        "top_p=0.95 alone": {"top_p": 0.95},
        "min_p=0.05": {"min_p": 0.05},
    }
    if args.cases:
        wanted = tuple(name.strip() for name in args.cases.split(","))
        cases = {name: fields for name, fields in cases.items() if name.startswith(wanted)}
    tokens = args.rows * keep
    print(
        f"scoring pass: {args.rows} x ({args.prompt} + {keep}) tokens, hidden {args.hidden}, {args.layers} layers, "
        f"vocabulary {args.vocabulary:,}, {args.dtype} on {args.device}: {seconds_pass * 1e3:.0f} ms "
        f"(the fix's chunks: {processed.CHUNK_ELEMENTS:,} elements; top-k/top-p: {args.rule})"
    )
    print(f"  {'settings':<28} {'core':<7} {'logits read (TRL 1.9.1)':>30} {'projected (TRL 1.16 fused head)':>34}")
    for name, fields in cases.items():
        measured: dict[str, list[float]] = {}
        for label, core in cores.items():
            distribution = core.SamplingDistribution(temperature=1.0, **fields)
            layer = core.OutputLayer(model.lm_head.weight)
            seconds = [
                timed(
                    lambda c=core, d=distribution, s=source, o=layer: scored(c, hidden, o, s, completion, d, trl_logps)
                )
                for source in (logits, None)
            ]
            measured[label] = seconds
            cells = [f"{t * 1e3:7.1f} ms {t / seconds_pass:7.2%} {t / tokens * 1e6:6.1f} us/t" for t in seconds]
            print(f"  {name:<28} {label:<7} {cells[0]:>30} {cells[1]:>34}")
        if "before" in measured:
            ratios = [after / before for after, before in zip(measured["after"], measured["before"], strict=True)]
            print(f"  {'':<28} {'ratio':<7} {ratios[0]:>29.2f}x {ratios[1]:>33.2f}x  (after / before)")
    from trl_vlm_fixes.patches.sampling_parity import engine_steps

    verdicts = {
        f"{runner} {device} {dtype} V={vocabulary} scaled={scaled}": trusted
        for (runner, device, dtype, vocabulary, scaled), trusted in engine_steps._verdicts.items()
    }
    print(f"kernel used (it gave the engine's bits on its check): {verdicts or 'never checked (not CUDA)'}")


def core_of(checkout: str) -> Any:
    """The tensor core (``processed`` and ``distribution``) of another copy of the plugin, loaded beside this one."""
    import importlib
    import types

    package = types.ModuleType("_before_sampling_parity")
    package.__path__ = [os.path.join(checkout, "trl_vlm_fixes", "patches", "sampling_parity")]
    sys.modules[package.__name__] = package
    core: Any = importlib.import_module(f"{package.__name__}.processed")
    core.SamplingDistribution = importlib.import_module(f"{package.__name__}.distribution").SamplingDistribution
    return core


def scored(core: Any, hidden: Any, layer: Any, logits: Any, ids: Any, distribution: Any, trl_logps: Any) -> Any:
    """The fix's work for one model call as its output layer's hook does it: TRL's logits read whole where only a ban
    or nothing is at stake, else one completion at a time (a view each); or the hidden states projected (TRL 1.16's
    fused head)."""
    if logits is None:
        return core.score(core.Positions(hidden, layer), ids, distribution, 1.0).finish(trl_logps)
    if core.Scorer(distribution, 1.0).ban_alone:  # the hook scores the whole call at once (the rows' lengths)
        whole = core.Positions(hidden, layer, logits, [logits.size(1)] * logits.size(0))
        return core.score(whole, ids, distribution, 1.0).finish(trl_logps)
    parts = [
        core.score(core.Positions(hidden[row], layer, logits[row]), ids[row], distribution, 1.0)
        for row in range(logits.size(0))
    ]
    return [part.finish(trl_logps[row]) for row, part in enumerate(parts)]


if __name__ == "__main__":
    main()
