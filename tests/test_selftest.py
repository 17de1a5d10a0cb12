"""The self-test shows each bug and each fix on the installed stack, and fails when an enabled fix does not work."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from helpers import environment_without_switches, gdn_prefill_acts, run_python, upstream_reloads_from_disk

import trl_vlm_fixes
from trl_vlm_fixes.selftest.runner import run_selftest


def _selftest(env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    environment = {**environment_without_switches(), **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "trl_vlm_fixes", "selftest", "--json"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    return result.returncode, json.loads(result.stdout)


def test_selftest_shows_bugs_and_fixes_on_this_stack() -> None:
    code, report = _selftest()
    assert code == 0 and report["verdict"] == "ok"
    fixes = report["fixes"]
    assert fixes["mm_realign"]["bug_present"] is True and fixes["mm_realign"]["fix_works"] is True
    assert fixes["cudagraph"]["bug_present"] is True and fixes["cudagraph"]["fix_works"] is True
    assert fixes["reload_skip"]["bug_present"] is upstream_reloads_from_disk()
    assert fixes["reload_skip"]["fix_works"] is True
    assert fixes["reload_skip"]["state"] == ("applied" if upstream_reloads_from_disk() else "not-needed")
    assert fixes["gdn_prefill"]["bug_present"] is gdn_prefill_acts() and fixes["gdn_prefill"]["fix_works"] is True
    assert fixes["gdn_prefill"]["state"] == ("applied" if gdn_prefill_acts() else "not-needed")
    assert set(report["versions"]) == {"trl", "vllm", "transformers", "torch"}


def test_selftest_reports_a_disabled_fix_without_failing() -> None:
    code, report = _selftest({"TRL_VLM_FIXES_MM_REALIGN": "0"})
    assert code == 0
    assert report["fixes"]["mm_realign"] == {
        **report["fixes"]["mm_realign"],
        "state": "disabled",
        "fix_works": None,
        "bug_present": True,
    }


def test_selftest_fails_when_an_enabled_fix_does_not_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import trl_vlm_fixes.patches.mm_realign.realign as realign

    monkeypatch.setattr(realign, "rebuild_mm_token_type_ids", lambda ids, *a, **k: ids * 0)  # a broken fix
    assert run_selftest() == 1
    output = capsys.readouterr().out
    assert "mm_realign         bug present: yes  fix works: no" in output and "FAIL: mm_realign" in output
    assert trl_vlm_fixes.status()["patches"]["mm_realign"]["state"] == "applied"


def test_selftest_reads_the_engine_mode_through_vllms_own_config() -> None:
    """The cudagraph verdict comes from what vLLM's CompilationConfig makes of the engine's arguments."""
    pytest.importorskip("vllm")
    from trl_vlm_fixes.patches.cudagraph import engine_cudagraph_mode

    assert engine_cudagraph_mode(None) == "vLLM default (graphs on)"
    assert engine_cudagraph_mode({"cudagraph_mode": "NONE"}) == "NONE"
    assert engine_cudagraph_mode({"cudagraph_mode": "piecewise", "mode": 3}) == "PIECEWISE"


def test_selftest_without_trl_names_what_to_install() -> None:
    result = run_python(
        """
        sys.modules["trl"] = None
        sys.modules["torch"] = None
        from trl_vlm_fixes.__main__ import main
        sys.exit(main(["selftest"]))
        """
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and len([line for line in lines if "selftest" in line]) == 1
    assert "torch, trl not installed" in result.stderr and "pip install torch trl" in result.stderr
