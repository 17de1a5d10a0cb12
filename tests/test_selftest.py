"""The self-test shows each bug and each fix on the installed stack, and fails when an enabled fix does not work.

The whole self-test runs once per stack (the first test: the installed console script, as a user runs it); every other
test runs the one or two checks it needs (``--only``), in this process where it can.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    environment_without_switches,
    gdn_prefill_acts,
    run_python,
    upstream_reloads_from_disk,
    without_version_drift,
)

import trl_vlm_fixes
from trl_vlm_fixes.__main__ import main
from trl_vlm_fixes.selftest.runner import render, run_selftest

CHECKED = ("mm_realign", "prompt_parity", "sampling_parity", "reload_skip", "wake_reset", "cudagraph", "gdn_prefill")
CHECKED += ("expert_layout", "vision_token_guard", "weight_buckets", "scoring_skip")


def _console_script() -> list[str]:
    """The installed ``trl-vlm-fixes`` beside this interpreter (CI: the wheel's), else ``python -m trl_vlm_fixes``."""
    script = Path(sys.executable).parent / "trl-vlm-fixes"
    return [str(script)] if script.exists() else [sys.executable, "-m", "trl_vlm_fixes"]


def test_the_whole_selftest_shows_bugs_and_fixes_on_this_stack_quietly() -> None:
    """The one run of every check on this stack: the verdicts, nothing but the report on stdout and nothing from the
    libraries on stderr (no weight-loading progress bars), and the fix it does not check named with its reason."""
    result = subprocess.run(
        [*_console_script(), "selftest", "--json"],
        capture_output=True,
        text=True,
        env=environment_without_switches(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout)
    assert without_version_drift(result.stderr) == [], result.stderr[-3000:]  # quiet: drift warnings are news
    assert report["verdict"] == "ok" and report["failed"] == []
    fixes = report["fixes"]
    assert tuple(fixes) == CHECKED
    assert fixes["mm_realign"]["bug_present"] is True and fixes["mm_realign"]["fix_works"] is True
    assert fixes["cudagraph"]["bug_present"] is True and fixes["cudagraph"]["fix_works"] is True
    assert fixes["reload_skip"]["bug_present"] is upstream_reloads_from_disk()
    assert fixes["reload_skip"]["fix_works"] is True
    assert fixes["reload_skip"]["state"] == ("applied" if upstream_reloads_from_disk() else "not-needed")
    assert fixes["gdn_prefill"]["bug_present"] is gdn_prefill_acts() and fixes["gdn_prefill"]["fix_works"] is True
    assert fixes["gdn_prefill"]["state"] == ("applied" if gdn_prefill_acts() else "not-needed")
    assert set(report["versions"]) == {"trl", "vllm", "transformers", "torch"}
    assert set(report["not_checked"]) == {"watchdog"} and "10 s limit" in report["not_checked"]["watchdog"]
    table = render(report).splitlines()
    assert table[0].startswith(f"trl_vlm_fixes {trl_vlm_fixes.__version__} self-test on trl ")
    assert any(line.startswith("watchdog           not checked: it acts only on a wedged engine") for line in table)


def test_selftest_reports_a_disabled_fix_without_failing(one_fix_off: Any, capsys: pytest.CaptureFixture[str]) -> None:
    one_fix_off("mm_realign")
    assert run_selftest(as_json=True, only=["mm_realign"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fixes"]["mm_realign"] == {
        **report["fixes"]["mm_realign"],
        "state": "disabled",
        "fix_works": None,
        "bug_present": True,
    }
    assert list(report["fixes"]) == ["mm_realign"]
    assert report["not_checked"] == {
        **{name: "not run (--only)" for name in CHECKED if name != "mm_realign"},
        "watchdog": report["not_checked"]["watchdog"],
    }


def test_selftest_fails_when_an_enabled_fix_does_not_work(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A broken fix fails the self-test; quiet by default (nothing the libraries write reaches the terminal, at the
    file-descriptor level), the table first."""
    import trl_vlm_fixes.patches.mm_realign.realign as realign

    monkeypatch.setattr(realign, "rebuild_mm_token_type_ids", lambda ids, *a, **k: ids * 0)  # a broken fix
    assert run_selftest(only=["mm_realign"]) == 1
    output, errors = capfd.readouterr()
    assert "mm_realign         bug present: yes  fix works: no" in output and "FAIL: mm_realign" in output
    assert output.startswith("trl_vlm_fixes ") and "watchdog           not checked: " in output
    assert "Loading weights" not in errors and "it/s]" not in errors and "selftest: mm_realign done" not in errors
    assert trl_vlm_fixes.status()["patches"]["mm_realign"]["state"] == "applied"


def test_selftest_verbose_says_each_check_as_it_ends(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--only", "gdn_prefill,cudagraph", "-v"]) == 0
    output, errors = capfd.readouterr()
    assert "trl_vlm_fixes selftest: cudagraph done in " in errors and "selftest: gdn_prefill done in " in errors
    assert output.startswith("trl_vlm_fixes ") and "cudagraph          bug present: yes  fix works: yes" in output


@pytest.mark.stack_independent  # the plugin's own declarations and argument parsing: no TRL/vLLM code is imported
def test_selftest_only_an_unknown_name_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["selftest", "--only", "mm_realign,nope"]) == 2
    error = capsys.readouterr().err
    assert f"no self-test check named nope; valid names: {', '.join(CHECKED)}" in error, error
    assert main(["selftest", "--only", "watchdog"]) == 2  # a fix, but one without a check: says why
    error = capsys.readouterr().err
    assert "no self-test check named watchdog (watchdog: it acts only on a wedged engine" in error, error
    assert "valid names: mm_realign, " in error and "Traceback" not in error


def test_selftest_reads_the_engine_mode_through_vllms_own_config() -> None:
    """The cudagraph verdict comes from what vLLM's CompilationConfig makes of the engine's arguments."""
    pytest.importorskip("vllm")
    from trl_vlm_fixes.patches.cudagraph import engine_cudagraph_mode

    assert engine_cudagraph_mode(None) == "vLLM default (graphs on)"
    assert engine_cudagraph_mode({"cudagraph_mode": "NONE"}) == "NONE"
    assert engine_cudagraph_mode({"cudagraph_mode": "piecewise", "mode": 3}) == "PIECEWISE"


@pytest.mark.stack_independent  # torch and TRL hidden: the plugin's own message, whatever stack is installed
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
