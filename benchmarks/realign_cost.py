"""mm_realign's cost: a fraction of `_get_per_token_logps_and_entropies` on the tiny model, and absolute at scale.

    python benchmarks/realign_cost.py
Goal: at most 1% of the scoring call. Both figures are measured in this run.
"""

from __future__ import annotations

import tempfile
import timeit

import torch


def per_call(fn, repeat: int = 7, number: int = 20) -> float:  # type: ignore[no-untyped-def]
    return min(timeit.repeat(fn, repeat=repeat, number=number)) / number


def main() -> None:
    from transformers import AutoProcessor

    import trl_vlm_fixes  # noqa: F401
    from trl_vlm_fixes.patches.mm_realign import realign_wrapper
    from trl_vlm_fixes.patches.mm_realign.realign import VisionCountCheck, rebuild_mm_token_type_ids
    from trl_vlm_fixes.selftest.fixtures import build_trainer, mixed_rows
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    scratch = tempfile.TemporaryDirectory()  # removed when main returns
    workdir = scratch.name
    model_dir = build_tiny_qwen35_vlm(f"{workdir}/tiny")
    processor = AutoProcessor.from_pretrained(model_dir)
    trainer = build_trainer(model_dir, processor, f"{workdir}/out")
    out = trainer._generate_and_score_completions(mixed_rows())
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    kwargs = dict(
        pixel_values=out["pixel_values"],
        image_grid_thw=out["image_grid_thw"],
        num_images=out["num_images"],
        mm_token_type_ids=out["mm_token_type_ids"],
    )
    original = type(trainer).__dict__["_get_per_token_logps_and_entropies"].__wrapped__

    def upstream_inputs_fixed() -> None:  # the scoring call itself, on already aligned markers
        original(
            trainer,
            trainer.model,
            ids,
            mask,
            out["completion_ids"].size(1),
            **{**kwargs, "mm_token_type_ids": rebuild_mm_token_type_ids(ids, trainer._image_pad_token_id, None)},
        )

    def with_realign() -> None:
        realign_wrapper(
            lambda *a, **k: None, trainer, (trainer.model, ids, mask, out["completion_ids"].size(1)), kwargs
        )

    with torch.no_grad():
        scoring = per_call(upstream_inputs_fixed, number=5)
        realign = per_call(with_realign, number=200)
    print(f"tiny model, batch {ids.shape[0]} x {ids.shape[1]} tokens")
    print(f"  _get_per_token_logps_and_entropies   {scoring * 1e3:9.3f} ms")
    print(f"  realign (rebuild + count check)      {realign * 1e3:9.3f} ms")
    print(f"  realign / scoring                    {realign / scoring:9.3%}   (goal <= 1%)")

    big = torch.randint(0, 256, (16, 8192))  # byte tokens only; the image run is placed below
    grid = torch.tensor([[1, 8, 8]] * 16)
    big[:, 100:116] = 261
    rebuild = per_call(lambda: rebuild_mm_token_type_ids(big, 261, 262), number=20)
    check = per_call(
        lambda: VisionCountCheck(rebuild_mm_token_type_ids(big, 261, 262), grid, [1] * 16, 2).raise_if_mismatched(),
        number=20,
    )
    print("B=16, L=8192 on this CPU")
    print(f"  rebuild                              {rebuild * 1e3:9.3f} ms")
    print(f"  rebuild + count check                {check * 1e3:9.3f} ms")


if __name__ == "__main__":
    main()
