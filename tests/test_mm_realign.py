"""mm_realign on the real stack: real TRL trainers, the real transformers Qwen3.5 classes, tiny random weights.

Every bug test first shows the bug with the fix reverted (upstream behaviour), then shows it gone with the fix on.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
from helpers import QWEN_FAMILIES

import trl_vlm_fixes
from trl_vlm_fixes.patches.mm_realign.realign import VisionTokenMismatchError, rebuild_mm_token_type_ids
from trl_vlm_fixes.selftest.batch_scoring import max_batch_vs_alone_gap, score_batch
from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, conversation, make_image, mixed_rows

# Orders of the four mixed samples: most crash upstream; the reversed one is scored silently wrong.
CRASHING_ORDER = [0, 1, 2, 3]
SILENT_ORDER = [3, 2, 1, 0]


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_mixed_batch_crashes_upstream(make_trainer: Any, fixes_off: None, kind: str) -> None:
    trainer = make_trainer(kind)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        trainer.train()


def padded_image_rows_per_step(trainer: Any) -> dict[int, int]:
    """Spy on TRL's scoring function: per training step, the rows whose prompt is padded and holds an image. Those,
    and only those, get markers other than TRL's right-padded ones (counted from the mask, not from our rebuild)."""
    from trl_vlm_fixes.patches.mm_realign import realign_wrapper

    counts: dict[int, int] = {}
    original = type(trainer)._get_per_token_logps_and_entropies.__wrapped__

    image_pad = trainer.processing_class.image_token_id

    @functools.wraps(original)
    def spy(self: Any, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, *a: Any, **k: Any) -> Any:
        prompt = slice(0, input_ids.size(1) - logits_to_keep)
        padded = (attention_mask[:, prompt] == 0).any(dim=1) & (input_ids[:, prompt] == image_pad).any(dim=1)
        step = self.state.global_step
        counts[step] = counts.get(step, 0) + int(padded.sum())
        return original(self, model, input_ids, attention_mask, logits_to_keep, *a, **k)

    import wrapt

    trainer._get_per_token_logps_and_entropies = wrapt.FunctionWrapper(spy, realign_wrapper).__get__(trainer)
    return counts


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_mixed_batch_trains_with_fix(make_trainer: Any, kind: str) -> None:
    trainer = make_trainer(kind)
    expected = padded_image_rows_per_step(trainer)
    trainer.train()
    assert trainer.state.global_step == 2
    realigned = [log["trl_vlm_fixes/mm_realigned_rows"] for log in trainer.state.log_history if "loss" in log]
    assert realigned == [float(expected[step]) for step in (0, 1)] and all(v >= 2 for v in realigned)


def test_upstream_scores_a_mixed_batch_silently_wrong(make_trainer: Any, processor: Any, fixes_off: None) -> None:
    trainer = make_trainer("grpo")
    rows = [mixed_rows()[i] for i in SILENT_ORDER]
    assert max_batch_vs_alone_gap(trainer, processor, rows) > 1e-3


@pytest.mark.parametrize("order", [CRASHING_ORDER, SILENT_ORDER, [1, 0, 3, 2]])
def test_each_row_scored_as_alone_with_fix(make_trainer: Any, processor: Any, order: list[int]) -> None:
    trainer = make_trainer("grpo")
    rows = [mixed_rows()[i] for i in order]
    assert max_batch_vs_alone_gap(trainer, processor, rows) <= 1e-5


def test_several_images_per_prompt(make_trainer: Any, processor: Any, fixes_off: None) -> None:
    rows = [
        {"prompt": conversation("two pictures", images=2), "images": [make_image(128, 96, 1), make_image(32, 32, 2)]},
        {
            "prompt": conversation("compare these two images in detail", images=2),
            "images": [make_image(64, 32, 3), make_image(96, 64, 4)],
        },
    ]
    trainer = make_trainer("grpo")
    with pytest.raises(RuntimeError):
        max_batch_vs_alone_gap(trainer, processor, rows)
    trl_vlm_fixes.apply()
    assert max_batch_vs_alone_gap(trainer, processor, rows) <= 1e-5


def test_pad_to_multiple_of(make_trainer: Any, processor: Any) -> None:
    trainer = make_trainer("grpo", pad_to_multiple_of=16)
    out, _ = score_batch(trainer, mixed_rows())
    assert out["prompt_ids"].size(1) % 16 == 0
    assert max_batch_vs_alone_gap(trainer, processor, mixed_rows()) <= 1e-5
    trainer.train()
    assert trainer.state.global_step == 2


def test_equal_length_batch_is_bit_identical_on_and_off(make_trainer: Any) -> None:
    same_shape = tuple((96, 64, text) for text in ("cats", "dogs"))
    rows = mixed_rows(same_shape)
    trainer = make_trainer("grpo")
    torch.manual_seed(0)
    out_on, logps_on = score_batch(trainer, rows)
    trl_vlm_fixes.revert()
    try:
        torch.manual_seed(0)
        out_off, logps_off = score_batch(trainer, rows)
    finally:
        trl_vlm_fixes.apply()
    assert torch.equal(out_on["completion_ids"], out_off["completion_ids"])
    assert torch.equal(logps_on, logps_off)


def test_rebuild_marks_images_and_videos(processor: Any) -> None:
    """Image pad -> 1, video pad -> 2, everything else 0: what the processor builds for an unpadded row."""
    import numpy as np

    video = [np.full((64, 64, 3), 40 * i, dtype=np.uint8) for i in range(4)]
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "text", "text": "hm"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encoded = processor(text=[text], images=[make_image(64, 32)], videos=[video], return_tensors="pt")
    tokenizer = processor.tokenizer
    rebuilt = rebuild_mm_token_type_ids(
        encoded["input_ids"],
        tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        tokenizer.convert_tokens_to_ids("<|video_pad|>"),
    )
    assert (rebuilt == 2).any() and (rebuilt == 1).any()
    assert torch.equal(rebuilt, encoded["mm_token_type_ids"].to(rebuilt.dtype))


def test_videos_get_the_same_rope_positions_in_a_left_padded_batch(processor: Any, tiny_model_dir: Any) -> None:
    """Mixed video batch, left-padded like TRL's prompts: realigned markers give each row its unpadded positions."""
    import numpy as np
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)
    tokenizer = processor.tokenizer
    videos = [
        [np.full((64, 64, 3), 9 * i, dtype=np.uint8) for i in range(4)],
        [np.full((32, 64, 3), 9 * i, dtype=np.uint8) for i in range(2)],
    ]
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": t}]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for t in ("a", "a much longer question about every frame of this clip")
    ]
    left = processor(text=texts, videos=videos, padding=True, padding_side="left", return_tensors="pt")
    right = processor(text=texts, videos=videos, padding=True, padding_side="right", return_tensors="pt")
    realigned = rebuild_mm_token_type_ids(
        left["input_ids"],
        tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        tokenizer.convert_tokens_to_ids("<|video_pad|>"),
    )
    assert torch.equal(realigned, left["mm_token_type_ids"].to(realigned.dtype))
    assert not torch.equal(realigned, right["mm_token_type_ids"].to(realigned.dtype))  # what TRL would pass
    batch_positions, _ = model.model.get_rope_index(
        left["input_ids"], realigned, video_grid_thw=left["video_grid_thw"], attention_mask=left["attention_mask"]
    )
    for row in range(2):
        alone = processor(text=[texts[row]], videos=[videos[row]], return_tensors="pt")
        alone_positions, _ = model.model.get_rope_index(
            alone["input_ids"], alone["mm_token_type_ids"], video_grid_thw=alone["video_grid_thw"]
        )
        keep = left["attention_mask"][row].bool()
        assert torch.equal(batch_positions[:, row, keep], alone_positions[:, 0])


def test_truncated_image_raises_a_clear_error(make_trainer: Any) -> None:
    trainer = make_trainer("grpo")
    out, _ = score_batch(trainer, mixed_rows()[:2])
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    image_pad = trainer._image_pad_token_id
    first_pad = int((ids[1] == image_pad).nonzero()[0])
    ids[1, first_pad] = trainer.processing_class.tokenizer.convert_tokens_to_ids("a")  # as if truncation cut it
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    with pytest.raises(VisionTokenMismatchError, match=r"row 1: \d+ image tokens in input_ids, \d+ needed"):
        trainer._get_per_token_logps_and_entropies(
            trainer.model,
            ids,
            mask,
            out["completion_ids"].size(1),
            pixel_values=out["pixel_values"],
            image_grid_thw=out["image_grid_thw"],
            num_images=out["num_images"],
            mm_token_type_ids=out["mm_token_type_ids"],
        )


def test_unknown_pad_ids_leave_markers_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    from trl_vlm_fixes.patches.mm_realign import realign_wrapper

    class NoVisionIds:
        processing_class = None

    seen: dict[str, Any] = {}

    def scoring(
        model: Any,
        input_ids: Any,
        attention_mask: Any,
        logits_to_keep: int,
        mm_token_type_ids: Any = None,
        image_grid_thw: Any = None,
        num_images: Any = None,
    ) -> Any:
        seen["markers"] = mm_token_type_ids
        return "scored"

    markers = torch.tensor([[0, 1, 1, 0]])
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        result = realign_wrapper(
            scoring, NoVisionIds(), (None, torch.tensor([[5, 6, 6, 7]]), None, 1), {"mm_token_type_ids": markers}
        )
    assert result == "scored" and seen["markers"] is markers
    assert "no image or video pad token id is known" in caplog.text


def test_rebuild_is_vectorized_without_python_loops() -> None:
    """As many tensor operations for a 16 x 8192 batch as for a 1 x 4 row (no loop over rows or tokens), and the
    same markers as a plain per-token lookup."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for shape in ((1, 4), (16, 8192)):
        ids = torch.randint(0, 300, shape)
        with CountOps() as counter:
            markers = rebuild_mm_token_type_ids(ids, 261, 262)
        counts.append(counter.ops)
        lookup = {261: 1, 262: 2}
        assert markers.tolist() == [[lookup.get(t, 0) for t in row] for row in ids.tolist()]
    assert counts[0] == counts[1]


def test_mixed_samples_really_differ_in_length(processor: Any) -> None:
    lengths = set()
    for width, height, text in MIXED_SAMPLES:
        rendered = processor.apply_chat_template(conversation(text), tokenize=False, add_generation_prompt=True)
        encoded = processor(images=[make_image(width, height)], text=[rendered], return_tensors="pt")
        lengths.add(encoded["input_ids"].size(1))
    assert len(lengths) == len(MIXED_SAMPLES)


# --- every Qwen family, dense and MoE: the same bug and the same exact fix; every other model is left alone ------


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_every_qwen_family_crashes_or_misscores_upstream_and_scores_exactly_with_fix(
    family_model_dir: Any, tmp_path: Any, family: str
) -> None:
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.fixtures import build_trainer

    model_dir = family_model_dir(family)
    family_processor = AutoProcessor.from_pretrained(model_dir)
    assert family_processor.tokenizer.padding_side == "right"  # as users load it
    trainer = build_trainer(model_dir, family_processor, str(tmp_path), "grpo")
    assert trainer.model.config.model_type == family
    orders = (CRASHING_ORDER, SILENT_ORDER)
    trl_vlm_fixes.revert()
    try:
        upstream = []
        for order in orders:
            try:
                upstream.append(max_batch_vs_alone_gap(trainer, family_processor, [mixed_rows()[i] for i in order]))
            except RuntimeError as error:
                upstream.append(str(error))
    finally:
        trl_vlm_fixes.apply()
    assert any(isinstance(v, str) or v > 1e-3 for v in upstream), upstream
    for order in orders:
        assert max_batch_vs_alone_gap(trainer, family_processor, [mixed_rows()[i] for i in order]) <= 1e-5
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_model_with_another_rope_index_is_left_alone_with_one_log_line(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The family is decided by the code that reads the markers (``get_rope_index``), not by a name: another
    implementation steps aside, the same code under another model type acts."""
    from trl_vlm_fixes import log_once
    from trl_vlm_fixes.patches import mm_realign

    trainer = make_trainer("grpo")
    backbone = type(trainer.model.model)
    original = backbone.get_rope_index
    monkeypatch.setattr(trainer.model.config, "model_type", "glm4v")
    assert mm_realign.scope(trainer) is None  # a name alone changes nothing: the rope index is Qwen's

    def another_rope_index(self: Any, *args: Any, **kwargs: Any) -> Any:  # other code: markers read otherwise
        return original(self, *args, **kwargs)

    monkeypatch.setattr(backbone, "get_rope_index", another_rope_index)
    monkeypatch.setattr(log_once, "_said", set())
    seen: list[Any] = []
    markers = torch.tensor([[0, 1, 1, 0]])

    def scoring(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, mm_token_type_ids: Any) -> str:
        seen.append(mm_token_type_ids)
        return "scored"

    ids = torch.tensor([[5, trainer._image_pad_token_id, trainer._image_pad_token_id, 7]])
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        for _ in range(2):
            mm_realign.realign_wrapper(scoring, trainer, (trainer.model, ids, None, 1), {"mm_token_type_ids": markers})
    assert all(m is markers for m in seen) and len(seen) == 2
    lines = [r for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(lines) == 1 and "another get_rope_index" in lines[0].getMessage()
    assert "another get_rope_index" in (mm_realign.scope(trainer) or "")


def test_the_proven_code_is_what_transformers_ships_whatever_is_patched_when_first_asked(
    make_trainer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The proven implementations are read once per process: read while a runtime patch (a user's, another
    library's) had replaced Qwen3.5's get_rope_index, they once made the patch the proven code and Qwen3.5 itself
    "another get_rope_index" for the rest of the process (found by CI: it depended on which test came first)."""
    from trl_vlm_fixes import vision_tokens
    from trl_vlm_fixes.patches import mm_realign

    trainer = make_trainer("grpo")
    backbone = type(trainer.model.model)
    original = backbone.get_rope_index

    def patched_rope_index(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    vision_tokens._proven_codes.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(backbone, "get_rope_index", patched_rope_index)
            # every proven implementation found where transformers ships it, whatever is patched in
            assert len(vision_tokens._proven_codes()) == len(vision_tokens.PROVEN_ROPE_INDEX)
        vision_tokens._proven_codes.cache_clear()
        with monkeypatch.context() as patch:
            patch.setattr(backbone, "get_rope_index", patched_rope_index)
            assert "another get_rope_index" in (mm_realign.scope(trainer) or "")
        assert mm_realign.scope(trainer) is None
    finally:
        vision_tokens._proven_codes.cache_clear()


def test_a_text_model_is_left_alone(tiny_text_model_dir: Any) -> None:
    from transformers import AutoModelForCausalLM

    from trl_vlm_fixes.vision_tokens import markers_problem

    model = AutoModelForCausalLM.from_pretrained(tiny_text_model_dir)
    assert "has no get_rope_index" in (markers_problem(model) or "")


def test_shared_image_and_video_placeholder_is_left_alone(make_trainer: Any) -> None:
    from trl_vlm_fixes.patches import mm_realign
    from trl_vlm_fixes.vision_tokens import VisionTokens

    trainer = make_trainer("grpo")
    shared = trainer.processing_class.image_token_id
    assert "share one placeholder" in (mm_realign._steps_aside(trainer.model, VisionTokens(shared, shared)) or "")


def test_processor_ids_are_authoritative_and_a_failed_lookup_is_retried(make_trainer: Any) -> None:
    from types import SimpleNamespace

    from trl_vlm_fixes.patches.mm_realign import resolve_vision_ids

    trainer = make_trainer("grpo")
    image_id = trainer.processing_class.image_token_id
    trainer._image_pad_token_id = 7  # a wrong guess of TRL's must not win over the processor
    assert resolve_vision_ids(trainer, trainer.model).image == image_id

    holder = SimpleNamespace(processing_class=SimpleNamespace())
    assert (resolve_vision_ids(holder, None).image, resolve_vision_ids(holder, None).video) == (None, None)
    holder.processing_class.image_token_id, holder.processing_class.video_token_id = 11, 12
    assert (resolve_vision_ids(holder, None).image, resolve_vision_ids(holder, None).video) == (11, 12)


def test_completion_markers_are_never_rebuilt(processor: Any) -> None:
    """A placeholder the policy sampled stays text in the completion columns; TRL decides those (issue 14)."""
    from trl_vlm_fixes.patches.mm_realign.realign import realign_prompt_markers

    image = processor.image_token_id
    ids = torch.tensor([[0, image, image, 5, image, 6]])
    trl_markers = torch.tensor([[0, 0, 1, 1, 0, 0]])  # misaligned prompt, text completion
    realigned = realign_prompt_markers(ids, trl_markers, 4, image, processor.video_token_id)
    assert realigned.tolist() == [[0, 1, 1, 0, 0, 0]]
