"""wake_reset: every tensor vLLM's model computes with is right after every level-2 sleep, wake and push.

vLLM 0.25.1's real model classes, built on the CPU (``selftest/vllm_model``), serve as TRL's colocated engine
(``selftest/vllm_engine.VllmModelLLM``): TRL's real ``VLLMGeneration`` sleeps it at level 2, wakes it, reloads or
pushes into it, and its ``generate`` runs vLLM's own forward. A level-2 wake hands out NaN pages for the whole weights
pool (every tensor the model allocated at build, read from the model, not from the fix), as an unlucky driver does;
vLLM's buffer restore and TRL's push or reload then rewrite what they rewrite. The logits are compared, bit for bit,
with a fresh model's (float32). Qwen3-VL's tiny checkpoints have deepstack as the released ones do (2 levels).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import QWEN_FAMILIES

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

DEEPSTACK = ("qwen3_vl", "qwen3_vl_moe")


@pytest.fixture(autouse=True)
def _world_released_afterwards() -> Iterator[None]:
    """A dense and a MoE model need different vLLM worlds of one rank: each test builds its own, none outlives it."""
    yield
    from trl_vlm_fixes.selftest.vllm_engine import release

    release()


def _vllm_model_or_skip(model_dir: Path, moe_backend: str | None = None) -> Any:
    """vLLM's class for ``model_dir`` on the CPU; experts on vLLM's CPU backend (None: forwards run), or on Triton
    (as on Hopper: built, never run; vLLM 0.31's CPU backend prepacks with its CPU kernels, absent here)."""
    from trl_vlm_fixes.selftest.vllm_model import VllmModelUnavailable, build_vllm_model

    _skip_where_vllm_transposes_the_experts(model_dir)
    try:
        return build_vllm_model(model_dir, moe_backend=moe_backend)
    except VllmModelUnavailable as error:
        pytest.skip(f"vLLM's model class cannot be built on this machine: {error}")


def _skip_where_vllm_transposes_the_experts(model_dir: Path) -> None:
    """vLLM >= 0.26 loads a transformers 5 Qwen3-VL-MoE checkpoint, and takes TRL's push, in neither layout."""
    from transformers import AutoConfig

    from trl_vlm_fixes.moe_backend import fused_expert_layout_problem

    problem = fused_expert_layout_problem(AutoConfig.from_pretrained(model_dir))
    if problem:
        pytest.skip(f"{problem} (test_moe_weight_push shows it)")


def _generation(model_dir: Path) -> Any:
    from transformers import AutoProcessor

    _skip_where_vllm_transposes_the_experts(model_dir)

    from trl_vlm_fixes.selftest.vllm_engine import WakeCheck
    from trl_vlm_fixes.selftest.vllm_model import VllmModelUnavailable

    try:
        return WakeCheck(model_dir, AutoProcessor.from_pretrained(model_dir)).measure()
    except VllmModelUnavailable as error:
        pytest.skip(f"vLLM's model class cannot be built on this machine: {error}")


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_the_fix_resets_every_plain_tensor_a_forward_reads(
    family: str, family_model_dir: Callable[[str], Path]
) -> None:
    """Every tensor of the weights pool that is neither a parameter nor a buffer, in vLLM's class of each family:
    the deepstack rows (one tensor per level of the checkpoint's ``deepstack_visual_indexes``) and, on vLLM >= 0.31,
    each attention layer's ``_k/_v_scale_cpu`` are reset; the only others, each attention layer's ``q/k/v_range``
    (vLLM 0.25.1), are read by no forward while ``calculate_kv_scales`` is off, and reset when it is on."""
    import json

    from trl_vlm_fixes.patches.wake_reset.plain_tensors import read_by_forward
    from trl_vlm_fixes.selftest.vllm_engine import plain_pool_tensors

    model_dir = family_model_dir(family)
    built = _vllm_model_or_skip(model_dir, moe_backend="TRITON")
    plain = plain_pool_tensors(built.model)
    reset = {plain_tensor.name for plain_tensor in read_by_forward(built.model)}
    vision = json.loads((model_dir / "config.json").read_text())["vision_config"]
    levels = len(vision.get("deepstack_visual_indexes", []))
    deepstack = {name for name in plain if name.startswith("deepstack_input_embeds[")}
    assert len(deepstack) == levels and (levels > 0) == (family in DEEPSTACK)
    ranges = {name for name in plain if name.rsplit(".", 1)[-1] in ("q_range", "k_range", "v_range")}
    mirrors = {name for name in plain if name.rsplit(".", 1)[-1] in ("_k_scale_cpu", "_v_scale_cpu")}
    assert plain.keys() == deepstack | ranges | mirrors, "a plain tensor this test (and the fix) has not read"
    layers = {name.rsplit(".", 1)[0] for name in ranges}
    assert all(built.model.get_submodule(layer).calculate_kv_scales is False for layer in layers)
    assert reset == deepstack | mirrors

    # an fp8 KV cache with computed scales: the first forward divides by q/k/v_range, so then they are reset too
    for layer in layers:
        built.model.get_submodule(layer).calculate_kv_scales = True
    assert {plain_tensor.name for plain_tensor in read_by_forward(built.model)} == deepstack | ranges | mirrors


@pytest.mark.parametrize("family", DEEPSTACK)
def test_a_nan_wake_corrupts_every_generate_without_the_fix(
    family: str, family_model_dir: Callable[[str], Path], one_fix_off: Callable[[str], None]
) -> None:
    """The bug: reload_skip's push rewrites every parameter, vLLM restores every buffer, and still the deepstack rows
    hold the wake's NaN, added to the first text layers' hidden states: every logit is NaN."""
    one_fix_off("wake_reset")
    engine = _generation(family_model_dir(family))
    assert engine.sleeps == [2, 2, 2] and engine.wakes == 2 and engine.disk_reloads == 0
    assert len(engine.logits) == 2
    for served, fresh in engine.logits:
        assert not fresh.isnan().any() and served.isnan().all()


@pytest.mark.parametrize("family", DEEPSTACK)
def test_after_a_nan_wake_generate_runs_on_a_fresh_models_logits(
    family: str, family_model_dir: Callable[[str], Path]
) -> None:
    engine = _generation(family_model_dir(family))
    assert engine.sleeps == [2, 2, 2] and engine.wakes == 2 and engine.disk_reloads == 0
    assert len(engine.logits) == 2
    for served, fresh in engine.logits:
        assert torch.equal(served, fresh)


@pytest.mark.parametrize("family", ["qwen3_vl"])
def test_trls_own_reload_path_is_reset_too(
    family: str, family_model_dir: Callable[[str], Path], one_fix_off: Callable[[str], None]
) -> None:
    """reload_skip off: TRL 1.9.1 reloads the checkpoint from disk after the wake; the deepstack rows are still NaN
    there unless this fix resets them (it wraps TRL's generate, not reload_skip)."""
    from helpers import upstream_reloads_from_disk

    if not upstream_reloads_from_disk():
        pytest.skip("this TRL re-pushes after the wake itself (its path is the re-push one, tested above)")
    one_fix_off("reload_skip")
    engine = _generation(family_model_dir(family))
    assert engine.disk_reloads == 2
    for served, fresh in engine.logits:
        assert torch.equal(served, fresh)


def test_an_image_step_does_not_clean_a_longer_text_step(family_model_dir: Callable[[str], Path]) -> None:
    """Why every wake needs the reset: vLLM zeroes only the rows an image step wrote, so after an unlucky wake a text
    step longer than the last image step still reads NaN; after the reset both equal a fresh model's."""
    from PIL import Image

    from trl_vlm_fixes.patches.wake_reset.plain_tensors import read_by_forward, reset
    from trl_vlm_fixes.selftest.vllm_engine import WeightsPool, forward_logits, processed_image_prompt

    model_dir = family_model_dir("qwen3_vl")
    engine, fresh = _vllm_model_or_skip(model_dir), _vllm_model_or_skip(model_dir)
    image_ids, vision = processed_image_prompt(model_dir, "what is it?", Image.new("RGB", (64, 64), (200, 30, 90)))
    text_ids = list(range(3, 3 + len(image_ids) + 8))  # longer than the image step

    def served_after_wake(with_reset: bool) -> tuple[Any, Any]:
        pool = WeightsPool(engine.model)
        pool.sleep(2)
        pool.wake(float("nan"))
        with torch.no_grad():  # the push: every parameter rewritten, as TRL's sync_weights does
            for name, parameter in fresh.model.named_parameters():
                engine.model.get_parameter(name).copy_(parameter)
        if with_reset:
            reset(read_by_forward(engine.model))
        image = forward_logits(engine, str(model_dir), image_ids, vision)
        return image, forward_logits(engine, str(model_dir), text_ids)

    fresh_image = forward_logits(fresh, str(model_dir), image_ids, vision)
    fresh_text = forward_logits(fresh, str(model_dir), text_ids)
    image, text = served_after_wake(with_reset=False)
    assert torch.equal(image, fresh_image)  # the image step wrote its own rows
    assert text[len(image_ids) :].isnan().all()  # the rows it did not write: NaN (earlier ones too, through 0 * NaN)
    image, text = served_after_wake(with_reset=True)
    assert torch.equal(image, fresh_image) and torch.equal(text, fresh_text)
