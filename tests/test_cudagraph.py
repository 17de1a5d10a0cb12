"""cudagraph: the keyword arguments TRL's colocated engine constructor receives, and the real vLLM config they build:
vLLM's own mode in a fresh output_dir, PIECEWISE where its protection state records an engine hang, NONE where it
records two; an unreadable state protects (the restarts themselves: tests/test_resume.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import run_python

from trl_vlm_fixes import protection
from trl_vlm_fixes.patches.cudagraph import (
    VALID_MODES,
    CudagraphModeError,
    contribute,
    gated_deltanet_op_breaks_graphs,
    merge_compilation_config,
)
from trl_vlm_fixes.selftest.engine_standin import StandInLLM


def engine_kwargs(make_generation: Callable[..., Any], output_dir: Path | None = None) -> dict[str, Any]:
    with protection.building_in(output_dir):
        return dict(make_generation().llm.init_kwargs)


def hang_reports(base: Path, level: str) -> Path:
    """An output_dir as the watchdog leaves it: nothing ("fresh"), its record of an engine hang at step 3 ("hang"),
    or of engine hangs at steps 3 and 5 ("repeated"); written by its own recorder (as a process whose engine was
    built fresh)."""
    from trl_vlm_fixes.patches.watchdog import escalation

    folder = base / level
    folder.mkdir()
    built, protection._last_built = protection._last_built, None
    try:
        for step in (3, 5)[: ("fresh", "hang", "repeated").index(level)]:
            escalation.record("engine-step", step, 0, str(folder))
            protection._last_built = None
    finally:
        protection._last_built = built
    return folder


def test_a_fresh_engine_gets_vllms_own_mode_with_the_protection_armed(
    make_generation: Callable[..., Any], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """No hang reported: nothing is added to the compilation config (vLLM's default graphs, GDN decode captured: the
    fastest decode); the engine line says what vLLM built and that the protection is armed; status says why."""
    import trl_vlm_fixes

    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):  # a healthy engine's line is INFO
        kwargs = engine_kwargs(make_generation, hang_reports(tmp_path, "fresh"))
    assert "compilation_config" not in kwargs and "enforce_eager" not in kwargs
    line = _engine_line(caplog)
    assert "with cudagraph_mode=vLLM's own (protection armed: PIECEWISE after an engine hang" in line
    assert "cudagraph_mode=FULL_AND_PIECEWISE" in line.split("vLLM built: ")[1]  # read back from the engine
    detail = trl_vlm_fixes.status()["patches"]["cudagraph"]["detail"]
    assert "engine built with cudagraph_mode=FULL_AND_PIECEWISE" in detail
    assert "protection armed, no engine hang recorded in" in detail


@pytest.mark.parametrize("owner", ["VLLMGeneration alone", "watchdog off"])
def test_no_armed_claim_where_no_watched_trainer_owns_the_engine(
    make_generation: Callable[..., Any],
    make_trainer: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    one_fix_off: Callable[[str], None],
    caplog: pytest.LogCaptureFixture,
    owner: str,
) -> None:
    """A VLLMGeneration built by another user (OnlineDPO, GOLD, a script), or a GRPO trainer with the watchdog off:
    no hang can be recorded for that engine, so neither the line nor status says the protection is armed (it used to:
    "protection armed" everywhere)."""
    import trl.generation.vllm_generation as vllm_generation

    import trl_vlm_fixes

    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        if owner == "watchdog off":
            one_fix_off("watchdog")
            make_trainer("grpo", use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)
        else:
            make_generation()
    line = _engine_line(caplog)
    assert "protection armed" not in line and "cudagraph_mode=vLLM's own (not protected: no GRPO/RLOO trainer" in line
    detail = trl_vlm_fixes.status()["patches"]["cudagraph"]["detail"]
    assert "armed" not in detail and "no GRPO/RLOO trainer under the watchdog builds this engine" in detail


def test_switch_off_restores_upstream_arguments(make_generation: Callable[..., Any], one_fix_off: Any) -> None:
    one_fix_off("cudagraph")
    kwargs = engine_kwargs(make_generation)
    assert "compilation_config" not in kwargs and "enforce_eager" not in kwargs


@pytest.mark.parametrize("mode", VALID_MODES)
def test_each_mode_is_selectable(
    make_generation: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None], mode: str
) -> None:
    monkeypatch.setenv("TRL_VLM_FIXES_CUDAGRAPH_MODE", mode.lower())
    reapply()  # settings are read at apply()
    assert engine_kwargs(make_generation)["compilation_config"] == {"cudagraph_mode": mode}


def test_bad_mode_fails_with_the_valid_names(monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None]) -> None:
    monkeypatch.setenv("TRL_VLM_FIXES_CUDAGRAPH_MODE", "SOMETIMES")
    with pytest.raises(
        CudagraphModeError, match=r"SOMETIMES.*NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE"
    ):
        reapply()  # apply() reads and validates every setting


def test_bad_mode_fails_at_import() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import trl_vlm_fixes"],
        env={"TRL_VLM_FIXES_CUDAGRAPH_MODE": "fast", "PATH": ""},
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "TRL_VLM_FIXES_CUDAGRAPH_MODE='fast'" in result.stderr
    assert "FULL_DECODE_ONLY" in result.stderr


@pytest.mark.parametrize(
    ("existing", "expected"),
    [
        (None, {"cudagraph_mode": "NONE"}),
        (3, {"mode": 3, "cudagraph_mode": "NONE"}),
        (
            {"mode": 3, "cudagraph_capture_sizes": [1, 2]},
            {"mode": 3, "cudagraph_capture_sizes": [1, 2], "cudagraph_mode": "NONE"},
        ),
        ({"cudagraph_mode": "FULL", "mode": 3}, {"cudagraph_mode": "NONE", "mode": 3}),
    ],
)
def test_merge_keeps_other_fields(existing: Any, expected: dict[str, Any]) -> None:
    assert merge_compilation_config(existing, "NONE") == expected


def test_merge_reaches_the_engine_constructor() -> None:
    from trl_vlm_fixes.engine_args import EngineBuild

    existing = {"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}
    kwargs: dict[str, Any] = {"model": "m", "compilation_config": existing}
    hang = protection.Verdict(protection.Level.ENGINE_HANG, "a test's hang")
    build = EngineBuild("test", model_config=None, protection=hang)
    contribute(kwargs, build)
    assert kwargs["compilation_config"] == {**existing, "cudagraph_mode": "PIECEWISE"}
    assert existing == {"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}  # the caller's dict is not mutated
    assert build.changes and build.changes[0].startswith("cudagraph_mode=PIECEWISE (every Gated-DeltaNet kernel")
    assert build.protected_by == ["cudagraph"] and build.why["cudagraph"] == "protected: a test's hang"


def test_unknown_config_type_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="cannot merge into compilation_config of type str"):
        merge_compilation_config("fast", "NONE")


def test_mode_is_logged_once_per_engine(
    make_generation: Callable[..., Any], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        engine_kwargs(make_generation, hang_reports(tmp_path, "hang"))
    lines = [r for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]
    assert len(lines) == 1 and "cudagraph_mode=PIECEWISE (" in lines[0].getMessage()
    assert "Gated-DeltaNet kernel outside CUDA graphs" in lines[0].getMessage()
    assert "(protected: engine hangs recorded in " in lines[0].getMessage()  # the state it read
    assert "trl_vlm_fixes_protection.json (at steps 3): ENGINE_HANG)" in lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING  # protected after a hang: as the trainer-start line


def test_engine_is_built_without_rebinding_the_module_global(
    make_generation: Callable[..., Any], with_setting: Callable[[str, str], None]
) -> None:
    """While TRL's LLM(...) runs, the module's LLM is still the engine class: the arguments came another way."""
    import trl.generation.vllm_generation as vllm_generation

    with_setting("TRL_VLM_FIXES_CUDAGRAPH_MODE", "PIECEWISE")
    seen: list[Any] = []

    class WatchingEngine(StandInLLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(vllm_generation.__dict__.get("LLM"))
            super().__init__(*args, **kwargs)

    engine = make_generation(engine_class=WatchingEngine).llm
    assert engine.init_kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert seen == [WatchingEngine]


# --- against the real vLLM classes, where they import on the CPU -------------------------------------------


@pytest.fixture(scope="module")
def vllm_config() -> Any:
    return pytest.importorskip("vllm.config")


def test_valid_modes_are_vllms(vllm_config: Any) -> None:
    assert set(VALID_MODES) == {member.name for member in vllm_config.CUDAGraphMode}


@pytest.mark.parametrize("mode", VALID_MODES)
@pytest.mark.parametrize("existing", [None, 3, {"mode": 3, "cudagraph_capture_sizes": [1, 2, 4]}])
def test_real_compilation_config_gets_the_mode(vllm_config: Any, mode: str, existing: Any) -> None:
    config = vllm_config.CompilationConfig(**merge_compilation_config(existing, mode))
    assert config.cudagraph_mode == vllm_config.CUDAGraphMode[mode]
    if isinstance(existing, dict):
        assert list(config.cudagraph_capture_sizes) == [1, 2, 4] and int(config.mode) == 3


def test_real_compilation_config_object_is_copied_not_mutated(vllm_config: Any) -> None:
    original = vllm_config.CompilationConfig(mode=3, cudagraph_capture_sizes=[1, 2])
    merged = merge_compilation_config(original, "FULL_DECODE_ONLY")
    assert merged is not original and original.cudagraph_mode != vllm_config.CUDAGraphMode.FULL_DECODE_ONLY
    assert merged.cudagraph_mode == vllm_config.CUDAGraphMode.FULL_DECODE_ONLY
    assert list(merged.cudagraph_capture_sizes) == [1, 2] and int(merged.mode) == 3


def test_a_default_compilation_config_object_gets_the_mode(vllm_config: Any, tiny_model_dir: Any) -> None:
    """``CompilationConfig()`` as a user passes it: re-validating all its fields (``dataclasses.replace``) fails in
    vLLM's pydantic class (cudagraph_capture_sizes=None), which would break the engine build."""
    from vllm.engine.arg_utils import EngineArgs

    merged = merge_compilation_config(vllm_config.CompilationConfig(), "PIECEWISE")
    assert merged.cudagraph_mode == vllm_config.CUDAGraphMode.PIECEWISE
    engine_args = EngineArgs(model=str(tiny_model_dir), compilation_config=merged)
    assert engine_args.compilation_config.cudagraph_mode == vllm_config.CUDAGraphMode.PIECEWISE


def test_real_llm_accepts_the_injected_arguments(vllm_config: Any) -> None:
    import inspect

    from vllm import LLM

    parameters = inspect.signature(LLM.__init__).parameters
    assert "compilation_config" in parameters
    assert "enforce_eager" in parameters  # exists, and we never set it


def test_experimental_online_dpo_engine_gets_the_mode(
    tiny_model_dir: Any, processor: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, reapply: Callable[[], None]
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl.experimental.online_dpo.online_dpo_trainer as online_dpo
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    monkeypatch.setattr(online_dpo, "LLM", StandInLLM, raising=False)
    monkeypatch.setattr(online_dpo, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setenv("TRL_VLM_FIXES_CUDAGRAPH_MODE", "FULL_DECODE_ONLY")
    reapply()
    args = OnlineDPOConfig(
        output_dir=str(tmp_path),
        use_vllm=True,
        vllm_mode="colocate",
        use_cpu=True,
        report_to=[],
        max_new_tokens=4,
        per_device_train_batch_size=2,
    )
    trainer = OnlineDPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["hello", "world"]}),
        processing_class=processor.tokenizer,
    )
    assert trainer.llm.init_kwargs["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert online_dpo.LLM is StandInLLM


def test_the_mode_after_a_hang_splits_every_gated_deltanet_kernel_out_of_the_graphs(
    vllm_config: Any, make_generation: Callable[..., Any], tmp_path: Path
) -> None:
    """From vLLM 0.25.1's own code: the engine's mode after a hang is piecewise, vLLM's compilation config splits the
    captured graph at ``vllm::qwen_gdn_attention_core``, and that op is where Qwen3.5's GDN layer runs all its kernels
    (conv1d and recurrent attention, prefill and decode). The GPU probe (docs/gpu-results.md, section 9) shows it."""
    import ast
    import inspect
    import textwrap

    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    requested = engine_kwargs(make_generation, hang_reports(tmp_path, "hang"))["compilation_config"]
    config = vllm_config.CompilationConfig(mode=vllm_config.CompilationMode.VLLM_COMPILE, **requested)
    config.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert config.cudagraph_mode == vllm_config.CUDAGraphMode.PIECEWISE
    assert not config.cudagraph_mode.has_full_cudagraphs()  # no graph spans a whole forward pass
    assert "vllm::qwen_gdn_attention_core" in config.splitting_ops

    def calls(function: Any) -> set[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        return {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}

    forward = calls(gdn.QwenGatedDeltaNetAttention.forward_cuda)
    assert "qwen_gdn_attention_core" in forward
    assert "_forward_core" in calls(gdn.qwen_gdn_attention_core)  # conv1d + recurrent attention, behind the op
    assert "_forward_core" not in forward
    # every vLLM op forward_cuda calls is a split point: vLLM 0.31's fused decode op too (with the unfused one above,
    # at least one op is always found, so this cannot pass by finding none)
    source = ast.parse(textwrap.dedent(inspect.getsource(gdn.QwenGatedDeltaNetAttention.forward_cuda)))
    layer_ops = {
        f"vllm::{n.attr}"
        for n in ast.walk(source)
        if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "torch.ops.vllm"
    }
    assert "vllm::qwen_gdn_attention_core" in layer_ops and layer_ops <= set(config.splitting_ops), layer_ops


class _EagerStandIn(StandInLLM):
    """The engine as vLLM builds it when ``enforce_eager=True`` reaches it (``trl vllm-serve --enforce_eager``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "enforce_eager": True})


def _engine_line(caplog: pytest.LogCaptureFixture) -> str:
    [line] = [r.getMessage() for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]
    return line


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl_vlm_fixes: cudagraph: ")]


@pytest.mark.parametrize("setting", ["none", "enforce_eager", "VLLM_USE_BREAKABLE_CUDAGRAPH=1"])
def test_the_engine_line_says_what_vllm_built_and_warns_where_a_setting_changes_the_mode(
    make_generation: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    with_setting: Callable[[str, str], None],
    caplog: pytest.LogCaptureFixture,
    setting: str,
) -> None:
    """The mode is read back from the built engine's ``vllm_config`` (not what was asked): ``enforce_eager`` makes it
    NONE; vLLM's breakable graphs keep PIECEWISE's name while capturing the Gated-DeltaNet op (see below)."""
    with_setting("TRL_VLM_FIXES_CUDAGRAPH_MODE", "PIECEWISE")
    if setting.startswith("VLLM_"):
        monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        make_generation(engine_class=_EagerStandIn if setting == "enforce_eager" else None)
    line, warnings = _engine_line(caplog), _warnings(caplog)
    assert "with cudagraph_mode=PIECEWISE" in line  # what was asked
    built = "NONE" if setting == "enforce_eager" else "PIECEWISE"
    assert f"cudagraph_mode={built}." in line.split("vLLM built: ")[1]
    if setting == "none":
        assert warnings == []
    elif setting == "enforce_eager":
        assert len(warnings) == 1 and "enforce_eager=True: vLLM captures no CUDA graph at all" in warnings[0]
    elif gated_deltanet_op_breaks_graphs():  # vLLM >= 0.31: the GDN op is a break point, PIECEWISE holds
        assert warnings == []
    else:
        assert len(warnings) == 1 and "GDN decode IS captured although cudagraph_mode=PIECEWISE" in warnings[0]
    [record] = [r for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]
    assert record.levelno == (logging.WARNING if warnings else logging.INFO)  # INFO where vLLM built what was asked


def test_the_plugin_reads_whether_vllms_gated_deltanet_op_breaks_its_graphs() -> None:
    """What the VLLM_USE_BREAKABLE_CUDAGRAPH warning claims, checked against vLLM's own modules: with the variable
    set, vLLM's attention op is wrapped by ``@eager_break_during_capture`` (runs eagerly between graph segments); its
    Qwen Gated-DeltaNet op is wrapped on vLLM 0.31 and not on 0.25.1 (captured inside a segment). The plugin reads
    the same from vLLM's source, without importing it."""
    from trl_vlm_fixes.patches.cudagraph import GDN_OP, gated_deltanet_op_breaks_graphs

    result = run_python(
        f"""
        import importlib, json
        def wrapped(module, name):
            try:
                return hasattr(getattr(importlib.import_module(module), name), "__wrapped__")
            except (ImportError, AttributeError):
                return None
        print(json.dumps([
            wrapped("vllm.model_executor.layers.attention.attention", "unified_attention_with_output"),
            wrapped(*{list(GDN_OP)!r}),
        ]))
        """,
        env={"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"},
        with_vllm=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    attention, gated_deltanet = json.loads(result.stdout.strip().splitlines()[-1])
    if attention is None or gated_deltanet is None:
        pytest.skip("this vLLM has no breakable CUDA graphs or names its ops otherwise")
    assert attention is True
    assert gated_deltanet_op_breaks_graphs() is gated_deltanet


# --- the protection, graded by the protection state in output_dir -------------------------------------------------

# The rule (README): unset, vLLM's own mode until a hang; a pinned mode is the least protection the engine gets, and a
# hang can only raise it: PIECEWISE after an engine hang, NONE after a second (at any step).
GRADED = {
    None: {"fresh": None, "hang": "PIECEWISE", "repeated": "NONE"},
    "PIECEWISE": {"fresh": "PIECEWISE", "hang": "PIECEWISE", "repeated": "NONE"},
    "NONE": {"fresh": "NONE", "hang": "NONE", "repeated": "NONE"},
    "FULL_AND_PIECEWISE": {"fresh": "FULL_AND_PIECEWISE", "hang": "PIECEWISE", "repeated": "NONE"},
}


@pytest.mark.parametrize("pinned", list(GRADED))
def test_the_engine_gets_the_protection_its_output_dir_asks_for(
    make_generation: Callable[..., Any], with_setting: Callable[[str, str], None], tmp_path: Path, pinned: str | None
) -> None:
    if pinned is not None:
        with_setting("TRL_VLM_FIXES_CUDAGRAPH_MODE", pinned)
    built = {}
    for level in ("fresh", "hang", "repeated"):
        config = engine_kwargs(make_generation, hang_reports(tmp_path, level)).get("compilation_config")
        built[level] = None if config is None else config["cudagraph_mode"]
    assert built == GRADED[pinned]


UNREADABLE = {
    "empty": b"",
    "truncated": b'{"level": "REPEATED_HANG", "hangs": [{"step": 3, "ki',
    "binary": bytes(range(256)),
    "unknown level": b'{"level": "SOMETIMES", "hangs": []}',
    "a directory": None,
}


@pytest.mark.parametrize("content", list(UNREADABLE))
def test_an_unreadable_state_warns_and_protects(
    make_generation: Callable[..., Any], caplog: pytest.LogCaptureFixture, tmp_path: Path, content: str
) -> None:
    """An empty, truncated or binary state, or a directory with its name: a WARNING naming the file and the protected
    level, and a PIECEWISE engine; never a crash, never vLLM's own graphs in silence (before: an unreadable hang
    report gave "no engine hang reported")."""
    state = tmp_path / protection.STATE_FILE
    if UNREADABLE[content] is None:
        state.mkdir()
    else:
        state.write_bytes(UNREADABLE[content])  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        kwargs = engine_kwargs(make_generation, tmp_path)
    assert kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    [warning] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl_vlm_fixes: the protection")]
    assert f"the protection state {state} cannot be read (" in warning
    assert "the protected level ENGINE_HANG (cudagraph mode=PIECEWISE" in warning


@pytest.mark.stack_independent
def test_every_engine_hang_raises_the_level_one_step_and_nothing_lowers_it(tmp_path: Path) -> None:
    """The recorder's rule: an engine hang raises the level one step above the one its engine was built with, at any
    step; a hang of another kind is recorded and keeps the level; two ranks of one attempt hanging together raise it
    once; an unreadable state counts as ENGINE_HANG; the file is replaced whole (no temporary left)."""
    from trl_vlm_fixes.protection import Level, read_state, record_hang

    def hang(step: int, kind: str = "engine-step", built: Level | None = None) -> Level:
        protection._last_built = built
        try:
            return record_hang(tmp_path, step, kind, 0, kind == "engine-step")
        finally:
            protection._last_built = None

    assert hang(2) == Level.ENGINE_HANG
    assert hang(3, built=Level.NO_HANG) == Level.ENGINE_HANG  # a second rank of the attempt that hung at step 2
    assert hang(5, built=Level.ENGINE_HANG) == Level.REPEATED_HANG  # another step: raised all the same
    assert hang(6, "wake_up", built=Level.REPEATED_HANG) == Level.REPEATED_HANG  # kept, never lowered
    assert hang(7, built=Level.REPEATED_HANG) == Level.REPEATED_HANG  # the top stays the top
    level, hangs = read_state(tmp_path)
    assert level == Level.REPEATED_HANG and [(h["step"], h["kind"]) for h in hangs] == [
        (2, "engine-step"),
        (3, "engine-step"),
        (5, "engine-step"),
        (6, "wake_up"),
        (7, "engine-step"),
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == [protection.STATE_FILE]
    (tmp_path / protection.STATE_FILE).write_bytes(b"\x00\x01")
    assert hang(8, "sync_weights") == Level.ENGINE_HANG  # unreadable: the protected level, then recorded over it


@pytest.mark.parametrize("switch", ["TRL_VLM_FIXES_CUDAGRAPH", "TRL_VLM_FIXES"])
def test_switched_off_the_engine_is_upstream_after_any_hang(
    make_generation: Callable[..., Any], one_fix_off: Callable[[str], None], tmp_path: Path, switch: str
) -> None:
    """Upstream (the fix off, or every fix) the restart after a repeated engine hang runs the same graphs again."""
    repeated = hang_reports(tmp_path, "repeated")
    assert engine_kwargs(make_generation, repeated)["compilation_config"] == {"cudagraph_mode": "NONE"}  # fix on
    if switch == "TRL_VLM_FIXES":
        import trl_vlm_fixes

        trl_vlm_fixes.revert()
        try:
            kwargs = engine_kwargs(make_generation, repeated)
        finally:
            trl_vlm_fixes.apply()
    else:
        one_fix_off("cudagraph")
        kwargs = engine_kwargs(make_generation, repeated)
    assert "compilation_config" not in kwargs


def test_a_model_without_gated_deltanet_layers_is_untouched_after_a_hang(
    make_text_generation: Callable[..., Any], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    repeated = hang_reports(tmp_path, "repeated")
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"), protection.building_in(repeated):
        kwargs = dict(make_text_generation().llm.init_kwargs)
    assert "compilation_config" not in kwargs and "gdn_prefill_backend" not in kwargs
    [record] = [r for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]
    line = record.getMessage()
    assert "exactly as upstream" in line and "no engine fix acts on this model" in line
    assert record.levelno == logging.WARNING  # this start follows a hang, and nothing protects it: not a healthy run


def test_a_trainer_built_after_a_hang_says_which_mode_and_why(
    make_trainer: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real GRPOTrainer built where the watchdog recorded an engine hang: its engine is built PIECEWISE (the
    trainer's own output_dir is read while it builds), and the engine line, the trainer-start line and status name the
    mode and the state."""
    import trl.generation.vllm_generation as vllm_generation

    import trl_vlm_fixes
    from trl_vlm_fixes import trainer_start

    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    monkeypatch.setattr(trainer_start, "_announced", False)
    settings = {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": True}
    fresh = make_trainer("grpo", **settings)
    assert "compilation_config" not in fresh.vllm_generation.llm.init_kwargs
    output_dir = Path(fresh.args.output_dir)
    state = hang_reports(output_dir.parent, "hang") / protection.STATE_FILE
    state.rename(output_dir / state.name)
    monkeypatch.setattr(trainer_start, "_announced", False)
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        restarted = make_trainer("grpo", **settings)
    assert restarted.vllm_generation.llm.init_kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    why = f"engine hangs recorded in {output_dir / state.name} (at steps 3): ENGINE_HANG"
    start = [r.getMessage() for r in caplog.records if "at trainer start" in r.getMessage()][-1]
    assert f"cudagraph=applied (cudagraph_mode=PIECEWISE (protected: {why}))" in start
    engine_line = [r.getMessage() for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()][-1]
    assert f"(protected: {why})" in engine_line
    assert why in trl_vlm_fixes.status()["patches"]["cudagraph"]["detail"]


def test_the_server_engine_keeps_vllms_mode_unless_pinned(
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    with_setting: Callable[[str, str], None],
    tmp_path: Path,
) -> None:
    """`trl vllm-serve` (TRL 1.9.1, under the launcher): the server knows no trainer's output_dir, so its engine gets
    vLLM's own mode, and its line says no protection is armed there (it said "protection armed"), or the pinned mode
    (what the trainer's report on a server generate says to restart it with, test_watchdog.py)."""
    import types

    from helpers import server_engine_build_problem_in_llm_worker

    pytest.importorskip("vllm")
    if not server_engine_build_problem_in_llm_worker():
        pytest.skip("this TRL's vllm-serve execs vLLM's own server: server_flags advises instead")
    import trl.scripts.vllm_serve as vllm_serve
    import vllm.entrypoints.llm as llm_module

    worker = "def llm_worker(model):\n    from vllm import LLM\n    LLM(model=model)\n"
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(worker, vllm_serve.__file__, "exec"), namespace)
    monkeypatch.chdir(hang_reports(tmp_path, "repeated"))  # a state where the server runs: not the trainer's

    def served() -> dict[str, Any]:
        layer = vars(llm_module.LLM)["__init__"]
        while type(layer.__wrapped__) is not types.FunctionType:  # below every fix's wrapper
            layer = layer.__wrapped__
        received: list[dict[str, Any]] = []
        monkeypatch.setattr(layer, "__wrapped__", lambda self, *args, **kwargs: received.append(kwargs))
        namespace["llm_worker"](str(tiny_model_dir))
        return received[-1]

    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        assert "compilation_config" not in served()
    [line] = [r.getMessage() for r in caplog.records if "trl vllm-serve built the vLLM engine" in r.getMessage()]
    assert "cudagraph_mode=vLLM's own (not protected: trl vllm-serve reads no trainer's output_dir" in line
    with_setting("TRL_VLM_FIXES_CUDAGRAPH_MODE", "PIECEWISE")
    assert served()["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}


def _engine_record(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    [record] = [r for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]
    return record


def test_an_engine_that_vllm_built_otherwise_than_asked_warns(
    make_generation: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    reapply: Callable[[], None],
) -> None:
    """A pinned PIECEWISE that vLLM rewrites to NONE (it does for some option sets): the reading differs from what
    the fix asked, so the engine line is a WARNING and one line names both values (INFO where it is built as asked:
    test_the_built_mode_is_read_back_from_the_engine)."""
    from trl_vlm_fixes.selftest import engine_standin

    monkeypatch.setenv("TRL_VLM_FIXES_CUDAGRAPH_MODE", "piecewise")
    reapply()  # settings are read at apply()
    built_config = engine_standin.built_config

    def rewritten(kwargs: dict[str, Any]) -> Any:
        config = built_config(kwargs)
        config.compilation_config.cudagraph_mode = SimpleNamespace(name="NONE")
        return config

    monkeypatch.setattr(engine_standin, "built_config", rewritten)
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        make_generation()
    assert _engine_record(caplog).levelno == logging.WARNING
    mismatches = [r.getMessage() for r in caplog.records if "was asked" in r.getMessage()]
    assert mismatches == [
        "trl_vlm_fixes: vLLM built cudagraph_mode=NONE where cudagraph_mode=PIECEWISE was asked: the fix's setting "
        "is not in effect"
    ]


@pytest.mark.parametrize("problem", ["unreadable served config", "reading raises"])
def test_an_engine_build_the_fixes_cannot_judge_warns(
    problem: str,
    make_generation: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The served model's config cannot be read (no fix could decide), or the built engine's config cannot be read
    back: the engine line is a WARNING, naming the problem."""
    from trl_vlm_fixes import engine_args
    from trl_vlm_fixes.selftest import engine_standin

    if problem == "unreadable served config":
        monkeypatch.setattr(engine_args, "served_model_config", lambda trainer, kwargs: None)
        said = "the served model's config could not be read"
    else:

        class Unreadable:
            @property
            def compilation_config(self) -> Any:
                raise RuntimeError("no config")

        monkeypatch.setattr(engine_standin, "built_config", lambda kwargs: Unreadable())
        said = "could not be read: RuntimeError('no config')"
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        make_generation()
    record = _engine_record(caplog)
    assert record.levelno == logging.WARNING and said in record.getMessage(), record.getMessage()
