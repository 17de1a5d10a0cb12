"""The engine fixes ask the installed vLLM's own classes whether it takes their arguments before adding them: on
the vLLM of every CI environment (0.25.1, 0.31.0) they do; on a vLLM that renamed one, that fix steps aside with one
WARNING and the engine is built without it, never broken."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import flashinfer_gdn_prefill_kernel_replaced, last_json, run_python

from trl_vlm_fixes.patches import gdn_prefill
from trl_vlm_fixes.patches.cudagraph import VALID_MODES
from trl_vlm_fixes.patches.gdn_prefill import VALID_BACKENDS
from trl_vlm_fixes.vllm_arguments import cudagraph_mode_problem, engine_argument_problem

vllm_config = pytest.importorskip("vllm.config")


@pytest.mark.parametrize("backend", VALID_BACKENDS)
def test_the_installed_vllm_takes_every_backend(backend: str, tiny_model_dir: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    assert engine_argument_problem("gdn_prefill_backend", backend) is None
    engine_args = EngineArgs(model=str(tiny_model_dir), gdn_prefill_backend=backend)  # vLLM agrees
    assert engine_args.gdn_prefill_backend == backend


@pytest.mark.parametrize("mode", VALID_MODES)
def test_the_installed_vllm_takes_every_mode(mode: str) -> None:
    assert cudagraph_mode_problem(mode) is None
    assert vllm_config.CompilationConfig(cudagraph_mode=mode).cudagraph_mode == vllm_config.CUDAGraphMode[mode]


def test_problems_name_the_argument_the_value_and_what_vllm_takes() -> None:
    renamed = engine_argument_problem("gdn_prefill_kernel", "triton")
    assert renamed is not None and "no engine argument `gdn_prefill_kernel`" in renamed
    refused = engine_argument_problem("gdn_prefill_backend", "cutlass")
    assert refused is not None and "`gdn_prefill_backend=cutlass`" in refused and "triton" in refused
    unknown_mode = cudagraph_mode_problem("FULL_AND_NOTHING")
    assert unknown_mode is not None and "CUDAGraphMode.FULL_AND_NOTHING" in unknown_mode and "PIECEWISE" in unknown_mode


# A vLLM that renamed one argument, made in a fresh interpreter from the installed one before TRL or the plugin
# is imported: EngineArgs without `gdn_prefill_backend`, or a CUDAGraphMode without PIECEWISE.
DRIFT = {
    "gdn_prefill": """
import dataclasses
import vllm.engine.arg_utils as arg_utils
def _spec(f):
    if f.default is not dataclasses.MISSING:
        return (f.name, f.type, dataclasses.field(default=f.default))
    if f.default_factory is not dataclasses.MISSING:
        return (f.name, f.type, dataclasses.field(default_factory=f.default_factory))
    return (f.name, f.type)
arg_utils.EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", [_spec(f) for f in dataclasses.fields(arg_utils.EngineArgs) if f.name != "gdn_prefill_backend"]
)
DRIFTED_FIELDS = {f.name for f in dataclasses.fields(arg_utils.EngineArgs)}
""",
    "cudagraph": """
import enum
import vllm.config
vllm.config.CUDAGraphMode = enum.Enum("CUDAGraphMode", ["NONE", "FULL"])
DRIFTED_FIELDS = None
""",
}
BUILD = """
import json, logging, os
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
import trl_vlm_fixes
from transformers import AutoProcessor
from trl_vlm_fixes.selftest.rollout_schedule import build_generation
model_dir = os.environ["TINY_MODEL_DIR"]
generation = build_generation(model_dir, AutoProcessor.from_pretrained(model_dir), True, None)
kwargs = generation.llm.init_kwargs
states = {name: trl_vlm_fixes.status()["patches"][name] for name in ("cudagraph", "gdn_prefill")}
print(json.dumps({"states": states, "keys": sorted(kwargs), "compilation_config": str(kwargs.get("compilation_config")),
                  "accepted": DRIFTED_FIELDS is None or not (set(kwargs) - DRIFTED_FIELDS - {"model"})}))
"""


# a pinned mode: the cudagraph argument these tests follow (its default, vLLM's own mode, adds none until a hang)
PINNED_MODE = {"TRL_VLM_FIXES_CUDAGRAPH_MODE": "PIECEWISE"}


@pytest.mark.parametrize("drifted, kept", [("gdn_prefill", "cudagraph"), ("cudagraph", "gdn_prefill")])
def test_a_vllm_without_the_argument_gets_an_engine_without_it_and_one_warning(
    tiny_model_dir: Path, drifted: str, kept: str
) -> None:
    result = run_python(
        DRIFT[drifted] + BUILD, env={"TINY_MODEL_DIR": str(tiny_model_dir), **PINNED_MODE}, with_vllm=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = last_json(result)
    state = report["states"][drifted]
    warnings = [line for line in result.stderr.splitlines() if f"fix {drifted} cannot be applied" in line]
    if drifted == "gdn_prefill" and flashinfer_gdn_prefill_kernel_replaced():  # not needed here: nothing to warn of
        assert state["state"] == "not-needed" and warnings == [], result.stderr[-3000:]
        assert "gdn_prefill_backend" not in report["keys"] and report["accepted"]
        return
    assert state["state"] == "skipped", state
    assert len(warnings) == 1, result.stderr[-3000:]  # one, though the fix waits at two engine builders
    if drifted == "gdn_prefill":
        assert "no engine argument `gdn_prefill_backend`" in state["detail"]
        assert "gdn_prefill_backend" not in report["keys"]
        assert report["accepted"]  # every argument the engine got is one the drifted vLLM's EngineArgs takes
        assert "PIECEWISE" in report["compilation_config"]  # cudagraph still acts
    else:
        assert "CUDAGraphMode.PIECEWISE" in state["detail"] and "compilation_config" not in report["keys"]
    assert report["states"][kept]["state"] in ("applied", "not-needed")


def test_the_undrifted_build_passes_both_arguments(tiny_model_dir: Path) -> None:
    """The same program on the installed vLLM: the drift above is what removes each argument."""
    result = run_python(
        "DRIFTED_FIELDS = None\n" + BUILD, env={"TINY_MODEL_DIR": str(tiny_model_dir), **PINNED_MODE}, with_vllm=True
    )
    report = last_json(result)
    assert report["states"]["cudagraph"]["state"] == "applied", result.stderr[-3000:]
    assert "PIECEWISE" in report["compilation_config"]
    expected = "not-needed" if flashinfer_gdn_prefill_kernel_replaced() else "applied"
    assert report["states"]["gdn_prefill"]["state"] == expected
    assert ("gdn_prefill_backend" in report["keys"]) == (expected == "applied")


@pytest.mark.parametrize(
    "versions, needed",
    [
        ({"vllm": "0.25.1", "flashinfer-python": "0.6.13"}, True),
        ({"vllm": "0.25.1", "flashinfer-python": None}, True),
        ({"vllm": "0.26.0", "flashinfer-python": "0.6.14"}, False),
        ({"vllm": "0.31.0+cu130", "flashinfer-python": "0.7.0.post1"}, False),
        ({"vllm": "0.31.0", "flashinfer-python": None}, False),
        ({"vllm": "0.31.0", "flashinfer-python": "0.6.13"}, True),  # downgraded under --no-deps: the old kernel
        ({"vllm": None, "flashinfer-python": None}, True),
    ],
)
def test_gdn_prefill_is_needed_exactly_where_the_old_kernel_can_run(
    monkeypatch: pytest.MonkeyPatch, versions: dict[str, Any], needed: bool
) -> None:
    monkeypatch.setattr(gdn_prefill, "installed_version", versions.get)
    reason = gdn_prefill.kernel_gone_reason()
    assert (reason is None) == needed
    if reason:
        assert "0.6.14" in reason and f"vLLM {versions['vllm']}" in reason


def test_status_says_why_gdn_prefill_steps_aside() -> None:
    result = run_python(
        "import json, trl_vlm_fixes, trl.generation.vllm_generation\n"
        "print(json.dumps(trl_vlm_fixes.status()['patches']['gdn_prefill']))",
        with_vllm=True,
    )
    state = json.loads(result.stdout.splitlines()[-1])
    if flashinfer_gdn_prefill_kernel_replaced():
        assert state["state"] == "not-needed" and "replaced the SM90 GDN prefill kernel" in state["detail"], state
    else:
        assert state["state"] == "applied", state


def test_a_vllm_that_cannot_be_read_is_a_reason_to_step_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM installed but its classes unimportable (a broken install, a missing compiled part): each check names what
    it could not read instead of raising into the user's engine build."""
    import sys

    import vllm.engine.arg_utils

    def forget() -> None:  # both checks are cached per process
        engine_argument_problem.cache_clear()
        cudagraph_mode_problem.cache_clear()

    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", None)  # `from vllm.engine.arg_utils import ...` fails
    forget()
    try:
        engine = engine_argument_problem("gdn_prefill_backend", "triton")
        assert engine is not None and engine.startswith("cannot read vLLM's EngineArgs")
        mode = cudagraph_mode_problem("PIECEWISE")
        assert mode is not None and mode.startswith("cannot read vLLM's EngineArgs")
        monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", vllm.engine.arg_utils)  # readable again
        monkeypatch.setitem(sys.modules, "vllm.config", None)
        forget()
        mode = cudagraph_mode_problem("PIECEWISE")
        assert mode is not None and mode.startswith("cannot read vLLM's CompilationConfig"), mode
    finally:
        forget()
