"""`trl-vlm-fixes status --model PATH --mode ...`: each fix's verdict for a checkpoint of every Qwen family and every
mode, read from the fixes' declarations (`Fix.applies`), on the tiny checkpoints built offline.

The expected verdicts are the facts of each family (which has Gated-DeltaNet layers, routed experts, deepstack) and
of each mode, written here independently of the rules; a declaration that changes changes the verdict; the reasons
are the ones the fixes log for a built trainer (`scope`)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import QWEN_FAMILIES, environment_without_switches

import trl_vlm_fixes
from trl_vlm_fixes.applicability import STEPS_ASIDE, WILL_ACT, applicability
from trl_vlm_fixes.declaration import MODES, Plan

GATED_DELTANET = {"qwen3_5", "qwen3_5_moe"}
ROUTED_EXPERTS = {"qwen3_5_moe", "qwen3_vl_moe"}
DEEPSTACK = {"qwen3_vl", "qwen3_vl_moe"}
TRAINER_SIDE = {"mm_realign", "prompt_parity", "sampling_parity", "vision_token_guard", "watchdog"}
NO_VLLM = {"mm_realign", "vision_token_guard"}  # they act on TRL's own scoring and sampling


def trl_pushes_one_parameter_per_call() -> bool:
    """TRL 1.9.1's colocated push loops over ``named_parameters()`` itself; TRL 1.16 streams ``_iter_named_params``."""
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration

    return "_iter_named_params" not in inspect.getsource(VLLMGeneration.sync_weights)


def trls_rollout_and_loss_are_1_9_1() -> bool:
    import trl

    return trl.__version__ == "1.9.1"


def expected_to_act(family: str, mode: str, sleep_mode: bool, moe_backend_rearranges: bool) -> set[str]:
    """Which fixes act for ``family`` in ``mode``, from the families' facts (not from the rules under test)."""
    if mode == "none":
        return set(NO_VLLM)
    acting = set(TRAINER_SIDE)
    if family in GATED_DELTANET:
        acting |= {"cudagraph", "gdn_prefill"}
    if family in ROUTED_EXPERTS and (mode == "server" or moe_backend_rearranges):
        acting.add("expert_layout")
    if mode == "colocate" and trl_pushes_one_parameter_per_call():
        acting.add("weight_buckets")  # TRL's colocated per-parameter push, whatever the family
    if trls_rollout_and_loss_are_1_9_1():
        acting.add("scoring_skip")  # GRPO's scoring pass for the ratio, whatever the family, with vLLM
    if mode == "colocate" and sleep_mode:
        acting.add("reload_skip")
        if family in DEEPSTACK:
            acting.add("wake_reset")
    return acting


def decided_by_the_stack() -> set[str]:
    """The fixes this stack turns off or no longer needs (their installed state decides before the plan)."""
    trl_vlm_fixes.REGISTRY.import_targets()
    return {
        name
        for name in trl_vlm_fixes.REGISTRY.fixes
        if trl_vlm_fixes.REGISTRY.fix_state(name)[0] in ("disabled", "skipped", "not-needed")
    }


def acting(report: dict[str, Any]) -> set[str]:
    return {name for name, fix in report["fixes"].items() if fix["verdict"] == WILL_ACT}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", QWEN_FAMILIES)
@pytest.mark.parametrize("sleep_mode", [False, True], ids=["no-sleep", "sleep"])
def test_each_family_and_mode_gets_the_verdicts_of_its_layers(
    family: str, mode: str, sleep_mode: bool, family_model_dir: Callable[[str], Path]
) -> None:
    report = applicability(family_model_dir(family), mode, sleep_mode)
    assert report["model_type"] == family and report["mode"] == mode
    assert report["layers"] == {
        "gated_deltanet": family in GATED_DELTANET,
        "routed_experts": family in ROUTED_EXPERTS,
        "deepstack_levels": 2 if family in DEEPSTACK else 0,
    }
    # this machine has no GPU: vLLM's MoE backend is not one that rearranges the experts
    decided = decided_by_the_stack()
    assert acting(report) == expected_to_act(family, mode, sleep_mode, False) - decided
    for name, fix in report["fixes"].items():
        assert fix["verdict"] in (WILL_ACT, STEPS_ASIDE) and fix["reason"], name
        if mode == "none" and name not in NO_VLLM and name not in decided:  # the stack's own state says why first
            assert fix["reason"].startswith("use_vllm is off: "), fix
    assert any("server's process" in note for note in report["notes"]) == (mode == "server")


def test_expert_layout_acts_where_this_gpu_would_rearrange_the_experts(
    family_model_dir: Callable[[str], Path], simulated_gpu: Callable[[tuple[int, int], bool], None]
) -> None:
    """Colocate on a Blackwell GPU with FlashInfer (simulated): vLLM's default rearranges pushed experts."""
    simulated_gpu((10, 0), True)
    for family in QWEN_FAMILIES:
        report = applicability(family_model_dir(family), "colocate")
        expected = expected_to_act(family, "colocate", False, True) - decided_by_the_stack()
        assert acting(report) == expected, family


def test_a_text_only_checkpoint_has_no_vision_fix(tmp_path: Path) -> None:
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen3_text

    report = applicability(build_tiny_qwen3_text(tmp_path / "qwen3"), "colocate")
    assert "mm_realign" not in acting(report) and "vision_token_guard" not in acting(report)
    assert report["fixes"]["mm_realign"]["reason"] == "model type 'qwen3' has no get_rope_index reading vision markers"


def test_a_changed_declaration_changes_the_verdict(
    family_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verdicts are read from the declarations: a fix declared for every model acts on Qwen2.5-VL too, and one
    declared for none steps aside with its declared reason."""
    fixes = trl_vlm_fixes.REGISTRY.fixes
    qwen25 = family_model_dir("qwen2_5_vl")
    assert applicability(qwen25, "colocate")["fixes"]["cudagraph"]["verdict"] == STEPS_ASIDE
    if "cudagraph" not in decided_by_the_stack():
        monkeypatch.setitem(fixes, "cudagraph", dataclasses.replace(fixes["cudagraph"], applies=lambda plan: None))
        assert applicability(qwen25, "colocate")["fixes"]["cudagraph"]["verdict"] == WILL_ACT
    monkeypatch.setitem(fixes, "mm_realign", dataclasses.replace(fixes["mm_realign"], applies=lambda plan: "why"))
    assert applicability(qwen25, "none")["fixes"]["mm_realign"] == {
        "verdict": STEPS_ASIDE,
        "reason": "why",
        "switch": "TRL_VLM_FIXES_MM_REALIGN",
    }


def test_a_switched_off_fix_steps_aside_with_its_switch(
    family_model_dir: Callable[[str], Path], reapply: Callable[[], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRL_VLM_FIXES_MM_REALIGN", "0")
    reapply()
    verdict = applicability(family_model_dir("qwen3_5"), "none")["fixes"]["mm_realign"]
    assert verdict["verdict"] == STEPS_ASIDE and "TRL_VLM_FIXES_MM_REALIGN" in verdict["reason"]


def test_the_reasons_are_those_the_fixes_give_a_built_trainer(make_trainer: Any, tiny_model_dir: Path) -> None:
    """A GRPO trainer without vLLM on the tiny Qwen3.5: every fix its scope steps aside says the same as the plan."""
    make_trainer("grpo")
    planned = applicability(tiny_model_dir, "none")["fixes"]
    stepped = {
        name: patch["detail"].partition(": ")[2]
        for name, patch in trl_vlm_fixes.status()["patches"].items()
        if patch["state"] == "stepped-aside"
    }
    # fixes the plan sends aside for the mode (not those this stack already turned off or no longer needs)
    expected = {n for n, fix in planned.items() if fix["reason"].startswith("use_vllm is off: ")}
    assert stepped and set(stepped) <= expected, (stepped, expected)
    assert {name: planned[name]["reason"] for name in stepped} == stepped
    assert all(planned[name]["verdict"] == STEPS_ASIDE for name in stepped)


def test_a_plan_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode 'remote'"):
        Plan({}, "remote")


def _cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trl_vlm_fixes", "status", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment_without_switches())


@pytest.mark.slow
def test_the_cli_gives_the_verdicts_of_the_api(family_model_dir: Callable[[str], Path]) -> None:
    """Through the real CLI, in a fresh interpreter: --json as the API says it; the table names each verdict."""
    model = family_model_dir("qwen3_5_moe")
    result = _cli("--model", str(model), "--mode", "server", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["version"] == trl_vlm_fixes.__version__ and "versions" in report
    assert {name: fix["verdict"] for name, fix in report["fixes"].items()} == {
        name: fix["verdict"] for name, fix in applicability(model, "server")["fixes"].items()
    }
    table = _cli("--model", str(family_model_dir("qwen3_vl")), "--mode", "colocate", "--sleep-mode")
    assert table.returncode == 0, table.stderr[-3000:]
    lines = {line.split()[0]: line for line in table.stdout.splitlines() if line.split()}
    assert "will act" in lines["wake_reset"] and "steps aside" in lines["cudagraph"]
    assert "has no Gated-DeltaNet layers" in lines["cudagraph"]


def test_the_cli_says_why_a_model_cannot_be_read(tmp_path: Path) -> None:
    result = _cli("--model", str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "cannot read" in result.stderr


def test_every_fix_declares_where_it_applies() -> None:
    """A fix left at the default would say `will act` for every model and mode: each fix declares its own rule."""
    from trl_vlm_fixes import declaration
    from trl_vlm_fixes.patches import ALL_FIXES

    undeclared = [fix.name for fix in ALL_FIXES if fix.applies is declaration._applies_everywhere]
    assert not undeclared, f"no applies= in the FIX(...) of {undeclared}"
