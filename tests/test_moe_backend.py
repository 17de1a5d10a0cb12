"""Which MoE backend the engine TRL builds would give the experts, and whether it rearranges them after loading
(``trl_vlm_fixes.moe_backend``), checked against vLLM's own oracle and configs.

No GPU here: vLLM's platform object is given a simulated CUDA class with a chosen compute capability, and vLLM's
FlashInfer probes are told FlashInfer is or is not installed; then vLLM's own ``select_unquantized_moe_backend``, on a
real ``FusedMoEConfig``, decides, and ``expected_moe_backend`` must decide the same.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import run_python
from simulated_gpu import QWEN35_MOE_TEXT, oracle_choice

from trl_vlm_fixes.moe_backend import (
    REARRANGING_BACKENDS,
    expected_moe_backend,
    expert_backend_argument,
    fused_expert_layout_problem,
    has_routed_experts,
    rearranging_moe_backend,
)

# A Qwen3.5-35B-A3B-shaped config (simulated_gpu.QWEN35_MOE_TEXT)
QWEN35_MOE: dict[str, Any] = {"model_type": "qwen3_5_moe", "text_config": QWEN35_MOE_TEXT}
DENSE: dict[str, Any] = {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "hidden_size": 2048}}
CAPABILITIES = [(8, 0), (9, 0), (10, 0), (10, 3), (12, 0)]
ENGINE_KWARGS: list[dict[str, Any]] = [
    {},
    {"moe_backend": "triton"},
    {"moe_backend": "flashinfer_cutlass"},
    {"moe_backend": "FlashInfer-TRTLLM"},
    {"kernel_config": {"moe_backend": "flashinfer_cutlass"}},
    {"data_parallel_size": 2},
    {"enable_lora": True},
]


def test_the_module_imports_neither_torch_nor_vllm() -> None:
    result = run_python(
        """
        import json, sys
        import trl_vlm_fixes.moe_backend
        print(json.dumps(sorted(m for m in ("torch", "vllm", "transformers", "trl") if m in sys.modules)))
        """,
        with_vllm=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("engine_kwargs", ENGINE_KWARGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("with_flashinfer", [True, False], ids=["flashinfer", "no-flashinfer"])
@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c[0]}{c[1]}")
def test_the_expected_backend_is_vllms_own_choice(
    simulated_gpu: Callable[[tuple[int, int], bool], None],
    capability: tuple[int, int],
    with_flashinfer: bool,
    engine_kwargs: dict[str, Any],
) -> None:
    simulated_gpu(capability, with_flashinfer)
    expected = expected_moe_backend(engine_kwargs, QWEN35_MOE)
    assert expected is not None
    vllm_choice = oracle_choice(engine_kwargs)
    if vllm_choice is None:  # vLLM refuses the backend asked for on this GPU: the engine never builds
        assert expected[1].startswith("moe_backend=")
    else:
        assert expected[0] == vllm_choice


@pytest.mark.parametrize(
    ("capability", "with_flashinfer", "engine_kwargs", "backend"),
    [
        ((10, 0), True, {}, "FLASHINFER_TRTLLM"),  # Blackwell's default
        ((12, 0), True, {}, "FLASHINFER_CUTLASS"),  # RTX Pro 6000 / RTX 5090's default
        ((9, 0), True, {"moe_backend": "flashinfer_cutlass"}, "FLASHINFER_CUTLASS"),  # asked for on Hopper
        ((10, 0), True, {"kernel_config": {"moe_backend": "flashinfer_trtllm"}}, "FLASHINFER_TRTLLM"),
    ],
)
def test_a_rearranging_backend_is_named_with_the_setting_to_change(
    simulated_gpu: Callable[[tuple[int, int], bool], None],
    capability: tuple[int, int],
    with_flashinfer: bool,
    engine_kwargs: dict[str, Any],
    backend: str,
) -> None:
    simulated_gpu(capability, with_flashinfer)
    assert oracle_choice(engine_kwargs) == backend  # vLLM's own oracle picks it
    reason = rearranging_moe_backend(engine_kwargs, QWEN35_MOE)
    assert reason is not None
    assert REARRANGING_BACKENDS[backend] in reason
    assert "moe_backend='triton'" in reason
    assert reason.count(". ") == 0  # one sentence
    # the setting it names is the cure: with it, vLLM picks Triton, and nothing is reported
    cured = {**engine_kwargs, **expert_backend_argument()}
    cured.pop("kernel_config", None)
    assert oracle_choice(cured) == "TRITON"
    assert rearranging_moe_backend(cured, QWEN35_MOE) is None


@pytest.mark.parametrize(
    ("capability", "with_flashinfer", "model_config", "engine_kwargs"),
    [
        ((9, 0), True, QWEN35_MOE, {}),  # Hopper: Triton first
        ((10, 0), False, QWEN35_MOE, {}),  # Blackwell without FlashInfer: Triton
        ((8, 0), True, QWEN35_MOE, {}),  # Ampere: FlashInfer's MoE needs SM90+
        ((10, 0), True, DENSE, {}),  # no experts
        ((10, 0), True, {**QWEN35_MOE, "quantization_config": {"quant_method": "fp8"}}, {}),  # other oracles
        ((10, 0), True, QWEN35_MOE, {"quantization": "bitsandbytes"}),
        ((10, 0), True, None, {}),  # an unreadable config
    ],
    ids=["hopper", "blackwell-no-flashinfer", "ampere", "dense", "fp8-checkpoint", "bitsandbytes", "no-config"],
)
def test_nothing_is_reported_where_pushes_land(
    simulated_gpu: Callable[[tuple[int, int], bool], None],
    capability: tuple[int, int],
    with_flashinfer: bool,
    model_config: Any,
    engine_kwargs: dict[str, Any],
) -> None:
    simulated_gpu(capability, with_flashinfer)
    assert rearranging_moe_backend(engine_kwargs, model_config) is None


def test_without_a_gpu_platform_nothing_is_determined() -> None:
    """This machine's vLLM platform (no GPU build): no backend to name, so no reason."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    assert not (current_platform.is_cuda() or current_platform.is_rocm())
    assert expected_moe_backend({}, QWEN35_MOE) is None
    assert rearranging_moe_backend({"moe_backend": "flashinfer_cutlass"}, QWEN35_MOE) is None


def test_the_argument_is_one_the_installed_vllm_takes() -> None:
    pytest.importorskip("vllm")
    from trl_vlm_fixes.vllm_arguments import engine_argument_problem

    ((name, value),) = expert_backend_argument().items()
    assert engine_argument_problem(name, value) is None
    assert engine_argument_problem(name, "flashinfer_cutlass") is None  # the values a user may have passed exist too
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    assert oracle.map_unquantized_backend(value).name == "TRITON"  # type: ignore[arg-type]
    assert set(REARRANGING_BACKENDS) - {"MOONEP"} <= set(oracle.UnquantizedMoeBackend.__members__)


def test_only_the_named_backends_rearrange_what_a_push_wrote() -> None:
    """vLLM's own conversion (the post-load step) on a pushed ``w13``: Triton keeps it, FlashInfer CUTLASS swaps its
    gate and up halves (TRTLLM's block layout needs FlashInfer and is taken from vLLM's source)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    w13 = torch.randn(4, 32, 16)
    w2 = torch.randn(4, 16, 16)
    moe_config: Any = type("Config", (), {"is_act_and_mul": True})()
    kept, _ = oracle.convert_to_unquantized_kernel_format(oracle.UnquantizedMoeBackend.TRITON, moe_config, w13, w2)
    swapped, _ = oracle.convert_to_unquantized_kernel_format(
        oracle.UnquantizedMoeBackend.FLASHINFER_CUTLASS, moe_config, w13.clone(), w2
    )
    gate, up = w13.chunk(2, dim=1)
    assert torch.equal(kept, w13)
    assert torch.equal(swapped, torch.cat([up, gate], dim=1))


def test_qwen3_5_moe_and_qwen3_vl_moe_have_routed_experts(tmp_path: Path) -> None:
    """Real configs: transformers' (the trainer's), config.json as a dict, and vLLM's ModelConfig for the engine."""
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    for family, experts in (("qwen3_5_moe", True), ("qwen3_vl_moe", True), ("qwen3_5", False)):
        model_dir = build_tiny_qwen35_vlm(tmp_path / family, family=family)
        assert has_routed_experts(AutoConfig.from_pretrained(model_dir)) is experts
        assert has_routed_experts(json.loads((model_dir / "config.json").read_text())) is experts
        assert has_routed_experts(_vllm_model_config(model_dir)) is experts
    assert has_routed_experts(QWEN35_MOE) and not has_routed_experts(DENSE) and not has_routed_experts(None)


def _vllm_model_config(model_dir: Path) -> Any:
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    from trl_vlm_fixes.selftest.vllm_model import checkpoint_overrides
    from trl_vlm_fixes.selftest.vllm_processor import transformers_config_classes_kept

    with transformers_config_classes_kept():
        overrides = checkpoint_overrides(model_dir)
        return ModelConfig(model=str(model_dir), tokenizer=str(model_dir), dtype="float32", hf_overrides=overrides)


@pytest.fixture
def qwen3_vl_moe_config() -> Iterator[Any]:
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    yield AutoConfig.for_model("qwen3_vl_moe")


def test_the_qwen3_vl_moe_layout_problem_is_read_from_the_installed_vllm(qwen3_vl_moe_config: Any) -> None:
    """vLLM >= 0.26 builds Qwen3-VL-MoE layers with ``is_fused_checkpoint_transposed=True``; 0.25.1 by shape."""
    pytest.importorskip("vllm")
    from vllm.model_executor.models import qwen3_vl_moe

    transposes = "is_fused_checkpoint_transposed=True" in inspect.getsource(qwen3_vl_moe)
    assert (fused_expert_layout_problem(qwen3_vl_moe_config) is not None) is transposes
    assert fused_expert_layout_problem(QWEN35_MOE) is None
    assert fused_expert_layout_problem(None) is None
