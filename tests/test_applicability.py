"""Applicability as data (issue 47): each fix declares where it acts (`Fix.applicability`: the families, the modes,
sleep mode, the versions where its bug exists, and the reason it steps aside for each exclusion). Its `applies`
(`status --model`) is derived from that data, README's model and mode tables are checked against it
(`tests/test_docs.py`), and here: the families it declares are those its rule lets through on the five Qwen
families' configs, and the versions it declares are those where the installed stack still has the bug."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from helpers import QWEN_FAMILIES
from test_docs import family_configs

import trl_vlm_fixes
from trl_vlm_fixes.declaration import MODES, Applicability, Fix, Plan, VersionBound
from trl_vlm_fixes.declaration import QWEN_FAMILIES as DECLARED_FAMILIES
from trl_vlm_fixes.patches import ALL_FIXES

# sampling_parity's declaration is its owner's to add (issue 47): until then its own `applies` is read instead
WITHOUT_DATA_YET: set[str] = set()
DECLARED = [fix for fix in ALL_FIXES if fix.applicability is not None]


def data(fix: Fix) -> Applicability:
    assert fix.applicability is not None
    return fix.applicability


@pytest.mark.stack_independent  # the declarations alone
def test_every_fix_declares_its_applicability_and_applies_is_derived_from_it() -> None:
    missing = {fix.name for fix in ALL_FIXES if fix.applicability is None}
    assert missing <= WITHOUT_DATA_YET, f"no applicability= in the FIX(...) of {sorted(missing - WITHOUT_DATA_YET)}"
    derived = [fix.name for fix in DECLARED if fix.applies != data(fix).reason]
    assert not derived, f"{derived} declare applies= beside applicability=: their rule is the data's"


@pytest.mark.stack_independent
def test_the_declared_families_are_the_tiny_checkpoints() -> None:
    from trl_vlm_fixes.selftest.tiny_model import FAMILIES

    assert list(DECLARED_FAMILIES) == QWEN_FAMILIES and set(FAMILIES) == set(DECLARED_FAMILIES)


# The rule on each Qwen family's config, on the transformers of each stack (mm_realign and prompt_parity read its
# get_rope_index): the families and modes declared are those the fix's rule acts for.
@pytest.mark.parametrize("fix", DECLARED, ids=lambda fix: fix.name)
def test_the_declared_families_and_modes_are_what_the_rule_decides(fix: Fix) -> None:
    configs = family_configs()
    planned = dataclasses.replace(data(fix), installed=None)  # the imported TRL's part: tests/test_weight_buckets.py
    for (family, config), mode, sleep_mode in itertools.product(configs.items(), MODES, (False, True)):
        reason = planned.reason(Plan(config, mode, sleep_mode, here=False))
        assert (reason is None) == planned.acts(mode, family, sleep_mode), (family, mode, sleep_mode, reason)


def test_the_declared_versions_are_where_the_installed_stack_has_the_bug() -> None:
    """A fix whose bug is bounded by versions is `not-needed` exactly where the installed versions are past them
    (gdn_prefill: vLLM >= 0.26 without an older FlashInfer; reload_skip: TRL >= 1.16): on both stacks."""
    registry = trl_vlm_fixes.REGISTRY
    registry.import_targets()
    bounded = [fix for fix in DECLARED if data(fix).versions]
    assert {"gdn_prefill", "reload_skip"} <= {fix.name for fix in bounded}
    for fix in bounded:
        state, detail = registry.fix_state(fix.name)
        present = any(bound.holds() for bound in data(fix).versions)
        assert (state != "not-needed") == present, (fix.name, [str(b) for b in data(fix).versions], state, detail)


@pytest.mark.stack_independent
def test_each_exclusion_says_why() -> None:
    declared = Applicability(
        modes=("colocate",),
        sleep_mode=True,
        aside={"none": "nothing to reload", "sleep_mode": "nothing is reloaded"},
        versions=(VersionBound("trl", "1.16.0"),),
    )
    assert declared.reason(Plan({}, "none", True)) == "use_vllm is off: nothing to reload"
    assert declared.reason(Plan({}, "server", True)) == "server mode without colocated sleep mode: nothing is reloaded"
    assert declared.reason(Plan({}, "colocate")) == "colocate mode without colocated sleep mode: nothing is reloaded"
    assert declared.reason(Plan({}, "colocate", True)) is None
    by_name = Applicability(
        modes=("colocate",), aside={"none": "a", "server": "b", "family": "is not one"}, families=("qwen3_5",)
    )
    assert by_name.reason(Plan({"model_type": "qwen3_vl"}, "server")) == "server mode: b"
    assert by_name.reason(Plan({"model_type": "qwen3_vl"}, "colocate")) == "model type 'qwen3_vl' is not one"
    assert by_name.reason(Plan({"model_type": "qwen3_5"}, "colocate")) is None
    assert by_name.acts("colocate", "qwen3_5") and not by_name.acts("colocate", "qwen3_vl")
    assert str(declared.versions[0]) == "trl < 1.16.0"


@pytest.mark.stack_independent
@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"modes": ("colocate",)}, "no aside['none']"),
        ({"modes": ("remote",)}, "mode 'remote'"),
        ({"aside": {"none": "a"}}, "aside['none'] is never said"),
        ({"sleep_mode": True, "aside": {"sleep_mode": "a"}}, "sleep_mode needs modes=('colocate',)"),
        ({"families": ("llama",), "aside": {"family": "a"}}, "families ['llama']"),
        ({"families": ("qwen3_5",)}, "no aside['family']"),
    ],
)
def test_a_declaration_that_leaves_an_exclusion_unexplained_is_refused(
    arguments: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Applicability(**arguments)  # type: ignore[arg-type]


@pytest.mark.stack_independent
def test_replace_keeps_applies_the_data_s_and_a_rule_given_in_its_place() -> None:
    fix = next(fix for fix in DECLARED if fix.name == "reload_skip")
    everywhere = Applicability()
    assert dataclasses.replace(fix, applicability=everywhere).applies(Plan({}, "none")) is None
    assert dataclasses.replace(fix, summary="x").applies == data(fix).reason
    assert dataclasses.replace(fix, applies=lambda plan: "why").applies(Plan({})) == "why"
