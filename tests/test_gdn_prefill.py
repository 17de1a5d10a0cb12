"""gdn_prefill: the colocated engine of a Gated-DeltaNet model gets the Triton/FLA prefill kernel, not FlashInfer's."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from helpers import flashinfer_gdn_prefill_kernel_replaced, run_python

from trl_vlm_fixes.patches.gdn_prefill import VALID_BACKENDS


@pytest.fixture
def old_kernel(monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None]) -> None:
    """FlashInfer 0.6.13 (the SM90 C++ prefill kernel) as far as the plugin can tell, whatever vLLM is installed: on
    vLLM >= 0.26 the fix is otherwise not-needed (tests/test_vllm_arguments.py), and these tests run on every stack."""
    from trl_vlm_fixes.patches import gdn_prefill
    from trl_vlm_fixes.versions import installed_version

    def versions(package: str) -> str | None:
        return "0.6.13" if package == "flashinfer-python" else installed_version(package)

    monkeypatch.setattr(gdn_prefill, "installed_version", versions)
    reapply()


@pytest.mark.usefixtures("old_kernel")
def test_gdn_model_engine_gets_triton_prefill_and_vllms_own_graphs(make_generation: Any) -> None:
    kwargs = make_generation().llm.init_kwargs
    assert kwargs["gdn_prefill_backend"] == "triton"
    assert "compilation_config" not in kwargs  # cudagraph: vLLM's own mode until a hang is reported


@pytest.mark.usefixtures("old_kernel")
def test_a_selected_flashinfer_prefill_gives_way_to_triton_after_an_engine_hang(
    make_generation: Any, with_setting: Callable[[str, str], None], tmp_path: Any, caplog: Any
) -> None:
    """The protection gdn_prefill declares: Triton from the first engine hang, whatever was selected (FlashInfer's
    prefill is the documented cause; before, a pinned FlashInfer was kept until a hang repeated at one step), and the
    engine line says the pin was moved."""
    import logging

    from test_cudagraph import engine_kwargs, hang_reports

    with_setting("TRL_VLM_FIXES_GDN_PREFILL_BACKEND", "flashinfer")
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        built = {level: engine_kwargs(make_generation, hang_reports(tmp_path, level)) for level in ("fresh", "hang")}
    assert built["fresh"]["gdn_prefill_backend"] == "flashinfer"
    assert built["hang"]["gdn_prefill_backend"] == "triton"
    line = [r.getMessage() for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()][-1]
    assert "gdn_prefill_backend=triton (TRL_VLM_FIXES_GDN_PREFILL_BACKEND=flashinfer moved to Triton after an " in line


@pytest.mark.usefixtures("old_kernel")
@pytest.mark.parametrize("backend", VALID_BACKENDS)
def test_backend_is_selectable(
    make_generation: Any, monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None], backend: str
) -> None:
    monkeypatch.setenv("TRL_VLM_FIXES_GDN_PREFILL_BACKEND", backend.upper())
    reapply()  # settings are read at apply()
    assert make_generation().llm.init_kwargs["gdn_prefill_backend"] == backend


def test_bad_backend_fails_the_import_naming_the_variable() -> None:
    result = run_python("import trl_vlm_fixes", env={"TRL_VLM_FIXES_GDN_PREFILL_BACKEND": "cutlass"})
    assert result.returncode != 0
    assert "TRL_VLM_FIXES_GDN_PREFILL_BACKEND='cutlass'" in result.stderr and "triton, flashinfer" in result.stderr


@pytest.mark.usefixtures("old_kernel")
@pytest.mark.parametrize("backend", VALID_BACKENDS)
def test_vllm_resolves_the_backend_the_engine_gets(
    make_generation: Any,
    tiny_model_dir: Any,
    monkeypatch: pytest.MonkeyPatch,
    reapply: Callable[[], None],
    backend: str,
) -> None:
    """The arguments TRL's engine receives, read by vLLM's own EngineArgs: the kernel vLLM will select."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("TRL_VLM_FIXES_GDN_PREFILL_BACKEND", backend)
    reapply()
    kwargs = make_generation().llm.init_kwargs
    names = {field.name for field in dataclasses.fields(EngineArgs)}
    engine_args = EngineArgs(**{key: value for key, value in kwargs.items() if key in names})
    assert engine_args.gdn_prefill_backend == backend


@pytest.mark.usefixtures("old_kernel")
def test_switch_off_leaves_the_backend_to_vllm(make_generation: Any, one_fix_off: Any) -> None:
    one_fix_off("gdn_prefill")
    kwargs = make_generation().llm.init_kwargs
    assert "gdn_prefill_backend" not in kwargs and "compilation_config" not in kwargs


def test_real_vllm_engine_args_take_both_backends() -> None:
    pytest.importorskip("vllm")
    import typing

    from vllm.engine.arg_utils import EngineArgs

    field = next(f for f in dataclasses.fields(EngineArgs) if f.name == "gdn_prefill_backend")
    literal = next(arg for arg in typing.get_args(field.type) if typing.get_origin(arg) is typing.Literal)
    assert set(VALID_BACKENDS) <= set(typing.get_args(literal))


def test_where_the_old_kernel_is_gone_the_engine_gets_no_backend_unless_asked(
    make_generation: Any, monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None]
) -> None:
    if not flashinfer_gdn_prefill_kernel_replaced():
        pytest.skip("this vLLM's FlashInfer has the SM90 C++ prefill kernel: the tests above cover it")
    assert "gdn_prefill_backend" not in make_generation().llm.init_kwargs
    monkeypatch.setenv("TRL_VLM_FIXES_GDN_PREFILL_BACKEND", "triton")  # asked for: honoured everywhere
    reapply()
    assert make_generation().llm.init_kwargs["gdn_prefill_backend"] == "triton"
