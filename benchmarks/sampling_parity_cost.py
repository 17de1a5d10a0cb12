"""sampling_parity's cost beside the scoring pass it joins, at Qwen3.5's vocabulary (248,320), measured in one run.

    python benchmarks/sampling_parity_cost.py [--hidden 1024] [--layers 8] [--rows 4] [--completion 256]
The fix adds no forward pass: in the no-gradient scoring pass that gives TRL's ``old_per_token_logps`` it reads the
same logits once more and computes, per sampled token, its log-prob under vLLM's processed distribution
(``patches/sampling_parity/processed.py``): for a ban alone a subtraction of the banned tokens' mass (no sort); with
truncation the trainer's own min-p/top-k/top-p over the vocabulary. That work is timed here against the pass itself
(the model's forward over prompt + completion and TRL's ``selective_log_softmax``), on the CPU, with a random Qwen3.5
text stack of the given size (3:1 Gated-DeltaNet/full attention, the real vocabulary). Both scale with the number of
scored tokens; the pass also with the model's size, so a larger model makes the ratio smaller.
Goal: a ban costs under 1% of the pass; truncation a few percent at most.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

VOCABULARY = 248_320  # Qwen3.5's


def best_of(function: Callable[[], Any], repeat: int = 3) -> float:
    timings = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        timings.append(time.perf_counter() - started)
    return min(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4, help="completions in one scoring chunk")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=256)
    args = parser.parse_args()

    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from trl.trainer.utils import selective_log_softmax

    from trl_vlm_fixes.patches.sampling_parity.distribution import SamplingDistribution
    from trl_vlm_fixes.patches.sampling_parity.processed import processed_shift

    torch.manual_seed(0)
    heads = max(2, args.hidden // 128)
    config = Qwen3_5TextConfig(
        vocab_size=VOCABULARY,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(args.layers)],
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=128,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        tie_word_embeddings=False,
    )
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units: a peaked distribution, as a trained model's
    ids = torch.randint(0, 1000, (args.rows, args.prompt + args.completion))
    keep = args.completion

    def scoring_pass() -> Any:  # what TRL's _get_per_token_logps_and_entropies does for one chunk
        with torch.no_grad():
            logits = model(input_ids=ids, logits_to_keep=keep + 1, use_cache=False).logits[:, :-1, :]
            return logits, selective_log_softmax(logits, ids[:, -keep:])

    seconds_pass = best_of(scoring_pass)
    logits, _ = scoring_pass()
    completion = ids[:, -keep:]
    cases = {
        "ban (8 placeholders)": SamplingDistribution(temperature=1.0, banned=tuple(range(248_000, 248_008))),
        "top_k=20, top_p=0.95 + ban": SamplingDistribution(
            temperature=1.0, top_k=20, top_p=0.95, banned=tuple(range(248_000, 248_008))
        ),
        "top_p=0.95 alone": SamplingDistribution(temperature=1.0, top_p=0.95),
        "min_p=0.05": SamplingDistribution(temperature=1.0, min_p=0.05),
    }
    tokens = args.rows * keep
    print(f"scoring pass: {args.rows} x ({args.prompt} + {keep}) tokens, hidden {args.hidden}, {args.layers} layers, "
          f"vocabulary {VOCABULARY:,}: {seconds_pass * 1e3:.0f} ms")
    for name, distribution in cases.items():
        seconds = best_of(lambda d=distribution: processed_shift(logits, completion, d, 1.0))
        print(f"  {name:<28} {seconds * 1e3:8.1f} ms  {seconds / seconds_pass:7.2%} of the pass"
              f"  ({seconds / tokens * 1e6:.1f} us per scored token)")


if __name__ == "__main__":
    main()
