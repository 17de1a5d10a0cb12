"""Tensor work of mm_realign: rebuild the modality markers from the ids the model sees, and check vision counts.

Everything here is vectorized and free of host-device synchronization: the count check produces tensors whose
verdict is read later (see ``VisionCountCheck``), after the forward pass has synchronized anyway.
"""

from __future__ import annotations

import torch

IMAGE_TYPE = 1
VIDEO_TYPE = 2


class VisionTokenMismatchError(ValueError):
    """A row's vision tokens do not match its ``image_grid_thw`` entries (e.g. an image cut by truncation)."""


def rebuild_mm_token_type_ids(
    input_ids: torch.Tensor,
    image_token_id: int | None,
    video_token_id: int | None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Qwen convention: image pad -> 1, video pad -> 2, else 0; aligned with ``input_ids`` by construction."""
    markers = torch.zeros_like(input_ids, dtype=dtype or input_ids.dtype)
    if image_token_id is not None:
        markers.masked_fill_(input_ids == image_token_id, IMAGE_TYPE)
    if video_token_id is not None:
        markers.masked_fill_(input_ids == video_token_id, VIDEO_TYPE)
    return markers


def realign_prompt_markers(
    input_ids: torch.Tensor,
    markers: torch.Tensor,
    prompt_columns: int,
    image_token_id: int | None,
    video_token_id: int | None,
) -> torch.Tensor:
    """Prompt columns rebuilt from ``input_ids``; completion columns keep the markers TRL gave them.

    TRL marks completions as text (zeros), except on its tool-image path, where it builds markers over the whole
    sequence itself: either way the completion part is TRL's to decide, and a token the policy sampled is never
    turned into a vision marker here.
    """
    if markers.shape == input_ids.shape:
        realigned = markers.clone()
    else:  # TRL always extends the markers over the completion; anything else is rebuilt and the rest left text
        realigned = torch.zeros_like(input_ids, dtype=markers.dtype)
    realigned[:, :prompt_columns] = rebuild_mm_token_type_ids(
        input_ids[:, :prompt_columns], image_token_id, video_token_id, dtype=markers.dtype
    )
    return realigned


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Number of rows whose markers the realign changed (a 0-dim tensor, read lazily for metrics)."""
    if before.shape != after.shape:
        return torch.tensor(after.size(0), device=after.device)
    return (before != after).any(dim=1).sum()


class VisionCountCheck:
    """Per-row image-token counts against ``image_grid_thw``, computed on device, judged when asked.

    On the CPU the verdict is immediate. On a GPU the two count vectors are copied to pinned host memory without
    blocking and an event is recorded; ``raise_if_mismatched`` reads them after the model's forward pass, which has
    already synchronized (its rope index reads the grids on the host), so the check adds no synchronization.
    """

    def __init__(
        self,
        mm_token_type_ids: torch.Tensor,
        image_grid_thw: torch.Tensor,
        num_images: list[int] | None,
        merge_size: int,
    ) -> None:
        rows = mm_token_type_ids.size(0)
        device = mm_token_type_ids.device
        if num_images is None:
            num_images = [1] * rows if image_grid_thw.size(0) == rows else []
        self.checkable = len(num_images) == rows and sum(num_images) == image_grid_thw.size(0)
        if not self.checkable:
            self._counts = None
            return
        tokens_per_image = image_grid_thw.prod(dim=-1) // (merge_size * merge_size)
        row_of_image = torch.repeat_interleave(torch.arange(rows), torch.tensor(num_images, dtype=torch.long))
        expected = torch.zeros(rows, dtype=tokens_per_image.dtype, device=device)
        expected.index_add_(0, row_of_image.to(device, non_blocking=True), tokens_per_image)
        actual = (mm_token_type_ids == IMAGE_TYPE).sum(dim=1).to(expected.dtype)
        counts = torch.stack([actual, expected])
        self._event: torch.cuda.Event | None = None
        if counts.is_cuda:
            host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            host.copy_(counts, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            counts = host
        self._counts = counts

    def raise_if_mismatched_from(self, error: BaseException) -> None:
        """After the forward pass failed: replace an opaque error by ours when the counts explain it."""
        try:
            self.raise_if_mismatched()
        except VisionTokenMismatchError as mismatch:
            raise mismatch from error

    def raise_if_mismatched(self) -> None:
        if self._counts is None:
            return
        if self._event is not None:
            self._event.synchronize()
        actual, expected = self._counts.tolist()
        bad = [row for row, (a, e) in enumerate(zip(actual, expected, strict=True)) if a != e]
        if bad:
            details = "; ".join(
                f"row {row}: {actual[row]} image tokens in input_ids, {expected[row]} needed by "
                f"its image_grid_thw entries"
                for row in bad
            )
            raise VisionTokenMismatchError(
                f"trl_vlm_fixes.mm_realign: {details}. An image was probably cut by truncation "
                "(max_prompt_length) or a completion contains image pad tokens. Raise max_prompt_length (or set it "
                "to None) so that every image stays whole; the batch was not scored rather than scored wrongly."
            )
