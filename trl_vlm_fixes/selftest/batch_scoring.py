"""Score a mixed batch the way TRL does, and each row alone, on the real trainer and model (tests, self-test)."""

from __future__ import annotations

from typing import Any

import torch


def score_batch(trainer: Any, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], torch.Tensor]:
    """Run TRL's own rollout + input building, then its scoring function on the whole batch."""
    out = trainer._generate_and_score_completions(rows)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            ids,
            mask,
            out["completion_ids"].size(1),
            batch_size=len(rows),
            pixel_values=out["pixel_values"],
            image_grid_thw=out["image_grid_thw"],
            num_images=out["num_images"],
            mm_token_type_ids=out["mm_token_type_ids"],
        )[0]
    return out, logps


def score_row_alone(trainer: Any, processor: Any, row: dict[str, Any], out: dict[str, Any], index: int) -> torch.Tensor:
    """The same prompt and completion, processed alone (no padding at all) and scored by the same function."""
    text = processor.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    images = row.get("images") or [row["image"]]
    encoded = processor(images=[images], text=[text], return_tensors="pt")
    prompt_ids = out["prompt_ids"][index][out["prompt_mask"][index].bool()]
    if encoded["input_ids"][0].tolist() != prompt_ids.tolist():
        raise AssertionError(f"row {index} alone must see the same prompt tokens as in the batch")
    completion = out["completion_ids"][index][out["completion_mask"][index].bool()]
    ids = torch.cat([encoded["input_ids"][0], completion])[None]
    markers = torch.cat([encoded["mm_token_type_ids"][0], torch.zeros_like(completion)])[None]
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            ids,
            torch.ones_like(ids),
            completion.numel(),
            pixel_values=encoded["pixel_values"],
            image_grid_thw=encoded["image_grid_thw"],
            num_images=[len(images)],
            mm_token_type_ids=markers,
        )[0]
    return logps[0]


def max_batch_vs_alone_gap(trainer: Any, processor: Any, rows: list[dict[str, Any]]) -> float:
    """Largest |batch log-prob - alone log-prob| over every real completion token of every row."""
    out, batch_logps = score_batch(trainer, rows)
    gap = 0.0
    for index, row in enumerate(rows):
        alone = score_row_alone(trainer, processor, row, out, index)
        length = alone.numel()
        gap = max(gap, (batch_logps[index, :length] - alone).abs().max().item())
    return gap
