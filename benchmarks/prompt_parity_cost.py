"""prompt_parity's cost per generate, beside work every image rollout already does, measured in one run.

    python benchmarks/prompt_parity_cost.py [--rows 128] [--image 896]
The fix's work per generate is Python over the prompt ids: collapse each image's run of pads (before) and compare vLLM's
returned ids with the trainer's (after); no tensor, no device. It is set beside two costs of the same batch that every
rollout pays already: TRL's tokenization of the prompts (the processor's ``apply_chat_template`` with the images) and,
where vLLM's multimodal processor builds here, vLLM's own processing of the prompts the engine receives.
Goal: at most 1% of either.
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
    parser.add_argument("--rows", type=int, default=128, help="prompts in one generate (a rank's rollout batch)")
    parser.add_argument("--image", type=int, default=896, help="image side in pixels (896: 784 pads per image)")
    args = parser.parse_args()

    from transformers import AutoProcessor

    from trl_vlm_fixes.patches.prompt_parity import mismatched_rows, unexpanded_prompts
    from trl_vlm_fixes.selftest.fixtures import make_image
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    scratch = tempfile.TemporaryDirectory()  # removed when main returns
    model_dir = build_tiny_qwen35_vlm(scratch.name)
    processor = AutoProcessor.from_pretrained(model_dir)
    text = "describe what you see in this picture in detail " * 20  # ~1k text tokens with the byte-level vocab
    images = [make_image(args.image, args.image - 32 * (k % 4), k) for k in range(args.rows)]
    conversations = [
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]
        for image in images
    ]

    def tokenize() -> list[list[int]]:  # what TRL's _tokenize_prompts does for this batch
        out = processor.apply_chat_template(conversations, tokenize=True, add_generation_prompt=True, return_dict=True)
        return [list(ids) for ids in out["input_ids"]]

    prompts = tokenize()
    row_images = [[image] for image in images]
    pad = processor.image_token_id
    sent, left = unexpanded_prompts(prompts, row_images, pad)
    assert not left
    returned = [list(ids) for ids in prompts]  # what vLLM reports with the fix: the trainer's ids, equal values

    def fix_work() -> None:
        unexpanded_prompts(prompts, row_images, pad)
        mismatched_rows(returned, prompts)

    tokenize_s = best_of(tokenize, repeat=3)
    fix_s = best_of(fix_work, repeat=5)
    tokens = sum(len(ids) for ids in prompts)
    print(f"batch: {args.rows} prompts, {tokens} prompt tokens ({tokens // args.rows} per prompt)")
    print(f"prompt_parity (collapse + compare):     {fix_s * 1e3:9.2f} ms")
    print(f"TRL's tokenization of the same batch:   {tokenize_s * 1e3:9.2f} ms   ratio {fix_s / tokenize_s:.2%}")
    try:
        from trl_vlm_fixes.selftest.vllm_processor import engine_prompt_ids, processor_for

        processor_for(str(model_dir))
    except Exception as error:  # noqa: BLE001 - the second comparison is optional here
        print(f"vLLM's processing of the same batch:      not measured ({type(error).__name__})")
        return

    def vllm_processing() -> None:
        for ids, image in zip(sent, images, strict=True):
            engine_prompt_ids(str(model_dir), ids, {"image": image})

    vllm_s = best_of(vllm_processing, repeat=2)
    print(f"vLLM's processing of the same batch:    {vllm_s * 1e3:9.2f} ms   ratio {fix_s / vllm_s:.2%}")


if __name__ == "__main__":
    main()
