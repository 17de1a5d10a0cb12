"""expert_layout: the engine TRL builds for a model with routed experts runs them on a backend whose layout TRL's
weight push writes.

The engine is TRL 1.9.1's real ``VLLMGeneration._init_vllm`` building the engine stand-in; the GPU is simulated
(``tests/simulated_gpu.py``) and vLLM's own oracle (``select_unquantized_moe_backend``) says which backend the
arguments TRL passed would give. That the backend then decides whether a push lands is shown with vLLM's real model
classes in ``tests/test_moe_weight_push.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from simulated_gpu import oracle_choice

pytest.importorskip("trl")
pytest.importorskip("vllm")


def _text(model_dir: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).text_config.to_dict()


class _Recorded:
    """An engine that only keeps its arguments and, as ``llm_engine.vllm_config``, the config vLLM resolves from
    them (the stand-in's; on a simulated GPU nothing of vLLM's GPU code can run)."""

    def __init__(self, **kwargs: Any) -> None:
        from trl_vlm_fixes.selftest.engine_standin import built_config

        self.init_kwargs = kwargs
        self.llm_engine = SimpleNamespace(vllm_config=built_config(kwargs))

    def sleep(self, level: int = 1) -> None:
        pass


def _engine_arguments(
    model_dir: Path, switch: Callable[[str, str], None] | None = None, on: bool = True
) -> dict[str, Any]:
    """The keyword arguments TRL's colocated ``LLM(...)`` call gets (``switch``: the ``with_setting`` fixture, to
    turn the fix off or on through its environment switch first)."""
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.rollout_schedule import build_generation

    if switch is not None:
        switch("TRL_VLM_FIXES_EXPERT_LAYOUT", "1" if on else "0")
    generation = build_generation(model_dir, AutoProcessor.from_pretrained(model_dir), engine_class=_Recorded)
    return dict(generation.llm.init_kwargs)


@pytest.mark.parametrize(
    ("capability", "default"), [((10, 0), "FLASHINFER_TRTLLM"), ((12, 0), "FLASHINFER_CUTLASS")], ids=["sm100", "sm120"]
)
def test_a_rearranging_default_is_replaced_by_triton_and_said(
    simulated_gpu: Callable[[tuple[int, int], bool], None],
    family_model_dir: Callable[[str], Path],
    with_setting: Callable[[str, str], None],
    caplog: pytest.LogCaptureFixture,
    capability: tuple[int, int],
    default: str,
) -> None:
    model_dir = family_model_dir("qwen3_5_moe")
    simulated_gpu(capability, True)
    upstream = _engine_arguments(model_dir, with_setting, on=False)
    assert "moe_backend" not in upstream
    assert oracle_choice(upstream, _text(model_dir)) == default  # the backend that rearranges what a push writes

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        fixed = _engine_arguments(model_dir, with_setting, on=True)
    assert fixed["moe_backend"] == "triton"
    assert oracle_choice(fixed, _text(model_dir)) == "TRITON"
    [line] = [r.getMessage() for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]
    assert f"moe_backend=triton (vLLM's default here, {default}, rearranges the experts" in line
    assert "moe_backend=triton" in line.split("vLLM built:")[1]  # read back from the engine's kernel_config


def test_hopper_and_a_dense_model_are_left_as_upstream(
    simulated_gpu: Callable[[tuple[int, int], bool], None],
    family_model_dir: Callable[[str], Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    simulated_gpu((9, 0), True)  # Hopper: vLLM puts Triton before FlashInfer
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        moe = _engine_arguments(family_model_dir("qwen3_5_moe"))
        simulated_gpu((10, 0), True)
        dense = _engine_arguments(family_model_dir("qwen3_5"))
    assert "moe_backend" not in moe and "moe_backend" not in dense
    lines = [r.getMessage() for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]
    assert (
        "expert_layout steps aside: vLLM runs the experts on TRITON (vLLM's default on compute capability 9.0)"
        in (lines[0])
    )
    assert "expert_layout steps aside: the served model (Qwen3_5Config) has no routed experts" in lines[1]


def test_a_rearranging_backend_asked_for_by_name_stops_the_build(
    simulated_gpu: Callable[[tuple[int, int], bool], None], family_model_dir: Callable[[str], Path]
) -> None:
    """Where the caller names the backend (``moe_backend`` or ``kernel_config``), the fix does not overrule it: the
    build stops with the backend and the setting to change."""
    from transformers import AutoConfig

    from trl_vlm_fixes.engine_args import EngineBuild
    from trl_vlm_fixes.patches.expert_layout import ExpertLayoutError, contribute

    simulated_gpu((9, 0), True)
    config = AutoConfig.from_pretrained(family_model_dir("qwen3_5_moe"))
    for asked in ({"moe_backend": "flashinfer_cutlass"}, {"kernel_config": {"moe_backend": "flashinfer_trtllm"}}):
        with pytest.raises(ExpertLayoutError, match=r"FlashInfer (CUTLASS|TRTLLM).*moe_backend='triton'"):
            contribute(dict(asked), EngineBuild("VLLMGeneration", config))
    kwargs: dict[str, Any] = {"moe_backend": "triton"}
    build = EngineBuild("VLLMGeneration", config)
    contribute(kwargs, build)
    assert kwargs == {"moe_backend": "triton"} and build.changes == []


@pytest.mark.parametrize(
    ("family", "capability", "expected"),
    [
        ("qwen3_5", (10, 0), "stepped-aside: the served model has no routed experts"),
        ("qwen3_5_moe", (9, 0), "stepped-aside: vLLM runs the experts on TRITON"),
        ("qwen3_5_moe", (10, 0), "applied"),
    ],
    ids=["dense", "moe-hopper", "moe-blackwell"],
)
def test_the_trainer_start_state_is_where_it_acts(
    monkeypatch: pytest.MonkeyPatch,
    simulated_gpu: Callable[[tuple[int, int], bool], None],
    family_model_dir: Callable[[str], Path],
    tmp_path: Path,
    family: str,
    capability: tuple[int, int],
    expected: str,
) -> None:
    import trl.generation.vllm_generation as vllm_generation
    from transformers import AutoProcessor

    from trl_vlm_fixes import REGISTRY
    from trl_vlm_fixes.selftest.fixtures import build_trainer

    model_dir = family_model_dir(family)
    simulated_gpu(capability, True)
    monkeypatch.setattr(vllm_generation, "LLM", _Recorded, raising=False)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *a, **k: True)
    trainer = build_trainer(model_dir, AutoProcessor.from_pretrained(model_dir), str(tmp_path), use_vllm=True)
    state, detail = REGISTRY.fix_state("expert_layout")
    assert f"{state}: {detail}".startswith(expected.split(": ")[0])
    assert expected.split(": ", 1)[-1] in f"{state}: {detail}"
    assert ("moe_backend" in trainer.vllm_generation.llm.init_kwargs) == (state == "applied")


def test_a_push_that_will_fail_is_said_at_the_engine_build(
    family_model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM >= 0.26 reads fused Qwen3-VL-MoE experts transposed, so TRL's first push fails with a size mismatch
    (tests/test_moe_weight_push.py shows it): the engine build says so, naming the cause; vLLM 0.25.1 takes both."""
    from transformers import AutoConfig

    from trl_vlm_fixes.moe_backend import fused_expert_layout_problem

    model_dir = family_model_dir("qwen3_vl_moe")
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        _engine_arguments(model_dir)
    said = [r.getMessage() for r in caplog.records if "TRL's weight push into this engine will fail" in r.getMessage()]
    expected = fused_expert_layout_problem(AutoConfig.from_pretrained(model_dir))
    assert said == (
        [f"trl_vlm_fixes.expert_layout: TRL's weight push into this engine will fail: {expected}"] if expected else []
    )
