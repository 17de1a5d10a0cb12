"""The plugin core: import order, idempotence, exact revert, switches, version and structural guards, status, CLI,
metrics, the engine-arguments mechanism and the trainer-start report."""

from __future__ import annotations

import inspect
import json
import logging
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    counters,
    environment_without_switches,
    expected_reload_skip_state,
    expected_states,
    gdn_prefill_acts,
    last_json,
    module_from_source,
    run_python,
    server_engine_build_problem_in_llm_worker,
    upstream_reloads_from_disk,
)

import trl_vlm_fixes

TARGET = "_get_per_token_logps_and_entropies"

PROBE = f"""
import wrapt
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer
import trl.generation.vllm_generation as vg
def layers(obj):  # the fixes' wrappers: a shared method's core wrapper counts the hooks it chains
    depth = 0
    while isinstance(obj, wrapt.FunctionWrapper):
        depth, obj = depth + len(getattr(obj._self_wrapper, "hooks", (obj,))), obj.__wrapped__
    return depth
import trl_vlm_fixes
print(json.dumps({{
    "grpo": layers(GRPOTrainer.__dict__["{TARGET}"]),
    "rloo": layers(RLOOTrainer.__dict__["{TARGET}"]),
    "generate": layers(vg.VLLMGeneration.__dict__["generate"]),
    "init_vllm": layers(vg.VLLMGeneration.__dict__["_init_vllm"]),
    "states": {{k: v["state"] for k, v in trl_vlm_fixes.status()["patches"].items()}},
}}))
"""


def expected_layers() -> dict[str, int]:
    """How many wrappers each probed method should carry: one per fix whose declaration targets it and is needed on
    this TRL (on a shared method, one hook each in the core's one wrapper), and one, the core's, on an engine builder
    where any engine fix is needed (read from the declarations: a new fix changes nothing here)."""
    probed = {
        "grpo": ("trl.trainer.grpo_trainer", f"GRPOTrainer.{TARGET}"),
        "rloo": ("trl.trainer.rloo_trainer", f"RLOOTrainer.{TARGET}"),
        "generate": ("trl.generation.vllm_generation", "VLLMGeneration.generate"),
        "init_vllm": ("trl.generation.vllm_generation", "VLLMGeneration._init_vllm"),
    }
    import importlib

    from trl_vlm_fixes.patches import ALL_FIXES

    layers = {}
    for key, (module_name, qualname) in probed.items():
        owner_name, _, attribute = qualname.partition(".")
        function = vars(getattr(importlib.import_module(module_name), owner_name))[attribute]
        function = inspect.unwrap(function)
        needed = [
            target
            for fix in ALL_FIXES
            for target in fix.targets
            if (target.module, target.qualname) == (module_name, qualname) and target.upstream_fixed(function) is None
        ]
        core_owned = any(target.core_owned for target in needed)  # the engine builder's one wrapper, the core's
        layers[key] = sum(not target.core_owned for target in needed) + core_owned
    return layers


@pytest.mark.parametrize(
    "before",
    [
        "import trl_vlm_fixes",  # plugin first
        "import trl.trainer.grpo_trainer, trl.trainer.rloo_trainer, trl.generation.vllm_generation",  # trl first
        "from trl import GRPOTrainer\nclass Mine(GRPOTrainer): pass\nimport trl_vlm_fixes",  # subclass defined first
    ],
)
def test_every_import_order_gives_the_same_patched_classes(before: str) -> None:
    report = last_json(run_python(before + "\n" + PROBE, with_vllm=before.startswith("import trl.")))
    assert report == {**expected_layers(), "states": expected_states()}


def test_plugin_import_imports_no_heavy_package_and_no_harness() -> None:
    """The import loads the core and the fixes' wrappers only: no torch/trl, no tensor core, no self-test harness."""
    report = last_json(
        run_python(
            """
        import trl_vlm_fixes
        print(json.dumps({
            "heavy": sorted(m for m in ("torch", "trl", "transformers", "vllm") if m in sys.modules),
            "ours": sorted(m for m in sys.modules if m.startswith("trl_vlm_fixes")),
        }))
    """,
            with_vllm=True,
        )
    )
    assert report["heavy"] == []
    assert "trl_vlm_fixes.patches.mm_realign" in report["ours"]  # the wrapper, not its tensor core
    assert not [m for m in report["ours"] if m.startswith("trl_vlm_fixes.selftest") or m.endswith(".realign")]


def test_double_import_and_apply_wrap_nothing_twice() -> None:
    report = last_json(
        run_python(
            "import trl_vlm_fixes, importlib\ntrl_vlm_fixes.apply()\ntrl_vlm_fixes.apply()\n"
            "importlib.reload(trl_vlm_fixes)\n" + PROBE
        )
    )
    assert {key: report[key] for key in expected_layers()} == expected_layers()


def _patched_methods() -> dict[tuple[type, str], Any]:
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.rloo_trainer import RLOOTrainer

    return {
        (cls, name): vars(cls)[name]
        for cls, name in (
            (GRPOTrainer, TARGET),
            (RLOOTrainer, TARGET),
            (GRPOTrainer, "log"),
            (RLOOTrainer, "log"),
            (VLLMGeneration, "generate"),
            (VLLMGeneration, "sync_weights"),
            (VLLMGeneration, "_init_vllm"),
        )
    }


def _class_dicts() -> list[dict[str, Any]]:
    return [dict(vars(cls)) for cls in {cls for cls, _ in _patched_methods()}]


def test_revert_restores_the_exact_objects_then_apply_again() -> None:
    import wrapt

    _patched_methods()
    trl_vlm_fixes.revert()
    originals = _patched_methods()
    dicts = _class_dicts()
    assert not any(isinstance(obj, wrapt.FunctionWrapper) for obj in originals.values())
    trl_vlm_fixes.apply()
    patched = _patched_methods()
    for key, obj in patched.items():  # sync_weights too: the watchdog watches it where reload_skip steps aside
        assert isinstance(obj, wrapt.FunctionWrapper), key
        while isinstance(obj, wrapt.FunctionWrapper):  # one layer per fix that wraps this method
            obj = obj.__wrapped__
        assert obj is originals[key]
    trl_vlm_fixes.apply()  # idempotent
    assert _patched_methods() == patched
    trl_vlm_fixes.revert()
    assert all(_patched_methods()[key] is original for key, original in originals.items())
    after = _class_dicts()
    assert [set(d) for d in after] == [set(d) for d in dicts]  # nothing left behind on any class
    assert {k: v["state"] for k, v in trl_vlm_fixes.status()["patches"].items()} == dict.fromkeys(
        expected_states(), "disabled"
    )
    trl_vlm_fixes.apply()
    states = {n: p["state"] for n, p in trl_vlm_fixes.status()["patches"].items()}
    assert states == expected_states()


def test_subclass_inherits_the_fix() -> None:
    import wrapt
    from trl import GRPOTrainer, RLOOTrainer

    class MyTrainer(GRPOTrainer):
        pass

    class MyRloo(RLOOTrainer):
        pass

    for subclass in (MyTrainer, MyRloo):
        assert TARGET not in vars(subclass)
        assert isinstance(inspect.getattr_static(subclass, TARGET), wrapt.FunctionWrapper)


def test_all_off_switch_at_import() -> None:
    report = last_json(run_python(PROBE, env={"TRL_VLM_FIXES": "0"}))
    assert report["states"] == dict.fromkeys(expected_states(), "disabled")
    assert (report["grpo"], report["rloo"], report["generate"], report["init_vllm"]) == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"TRL_VLM_FIXES": "off", "TRL_VLM_FIXES_MM_REALIGN": "1"}, ("disabled", "disabled", "disabled")),
        ({"TRL_VLM_FIXES_MM_REALIGN": "False"}, ("disabled", "applied", "applied")),
        ({"TRL_VLM_FIXES_RELOAD_SKIP": "NO"}, ("applied", "disabled", "applied")),
        ({"TRL_VLM_FIXES_CUDAGRAPH": "Off"}, ("applied", "applied", "disabled")),
        (
            {"TRL_VLM_FIXES": "yes", "TRL_VLM_FIXES_CUDAGRAPH": "TRUE", "TRL_VLM_FIXES_MM_REALIGN": "on"},
            ("applied", "applied", "applied"),
        ),
    ],
)
def test_switches(env: dict[str, str], expected: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import wrapt

    _patched_methods()  # import the targets first, so the states are final
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    trl_vlm_fixes.revert()
    try:
        trl_vlm_fixes.apply()  # reads the switches, as the import does
        states = trl_vlm_fixes.status()["patches"]
        if expected[1] == "applied":
            expected = (expected[0], expected_reload_skip_state(), expected[2])
        assert tuple(states[n]["state"] for n in ("mm_realign", "reload_skip", "cudagraph")) == expected
        methods = _patched_methods()
        from trl.generation.vllm_generation import VLLMGeneration
        from trl.trainer.grpo_trainer import GRPOTrainer

        for name, key in (
            ("mm_realign", (GRPOTrainer, TARGET)),
            ("reload_skip", (VLLMGeneration, "generate")),
            ("cudagraph", (VLLMGeneration, "_init_vllm")),
        ):
            chain = []  # the wrappers stacked on the method, outermost first (other fixes may wrap it too)
            layer = methods[key]
            while isinstance(layer, wrapt.FunctionWrapper):
                chain.append(layer)
                layer = layer.__wrapped__
            ours = {p.wrapper for k, p in trl_vlm_fixes.REGISTRY._patched.items() if k.startswith(f"{name}|")}
            assert bool(ours & set(chain)) == (states[name]["state"] == "applied")
    finally:
        monkeypatch.undo()
        trl_vlm_fixes.revert()
        trl_vlm_fixes.apply()


@pytest.mark.parametrize(
    "variable",
    [
        "TRL_VLM_FIXES",
        "TRL_VLM_FIXES_MM_REALIGN",
        "TRL_VLM_FIXES_RELOAD_SKIP",
        "TRL_VLM_FIXES_CUDAGRAPH",
        "TRL_VLM_FIXES_STRICT",
    ],
)
@pytest.mark.stack_independent  # the plugin's own switch parsing at its import: no TRL/transformers/vLLM imported
def test_bad_switch_value_fails_the_import_with_a_clear_error(variable: str) -> None:
    result = run_python("import trl_vlm_fixes", env={variable: "maybe"})
    assert result.returncode != 0
    assert "SwitchValueError" in result.stderr and f"{variable}='maybe'" in result.stderr
    assert "1/0, true/false, yes/no, on/off" in result.stderr


FAKE_VERSIONS = """
import importlib.metadata as md
real_version = md.version
fake = {"trl": "1.10.0", "vllm": "0.26.0+cu130"}
md.version = lambda name: fake.get(name) or real_version(name)
"""


def test_version_guard_warns_once_per_fix_and_still_applies() -> None:
    result = run_python(FAKE_VERSIONS + PROBE)
    report = last_json(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING") and "validated" in line]
    assert len(warnings) == len(expected_states())
    for fix in expected_states():
        switch = f"TRL_VLM_FIXES_{fix.upper()}"
        line = next(w for w in warnings if f"fix {fix} " in w)
        assert "trl 1.10.0 (validated: 1.9.1)" in line and switch + "=0" in line
    assert "vllm 0.26.0+cu130 (validated: 0.25.1)" in next(w for w in warnings if "fix cudagraph " in w)
    # the structural check decides, and the shape is right; a vLLM of 0.26 pins a FlashInfer without the old kernel
    assert report["states"] == {**expected_states(), "gdn_prefill": "not-needed"}


@pytest.mark.stack_independent  # the plugin's version comparison on faked versions: no TRL/vLLM imported
def test_local_version_tags_count_as_validated() -> None:
    result = run_python(
        FAKE_VERSIONS.replace('"1.10.0"', '"1.9.1+local"').replace("0.26.0+cu130", "0.25.1+cu130")
        + "import trl_vlm_fixes"
    )
    assert result.returncode == 0 and "validated:" not in result.stderr


CHANGED_SIGNATURE = f"""
import trl.trainer.grpo_trainer as g
def {TARGET}(self, model, input_ids, attention_mask, logits_to_keep):
    return None
g.GRPOTrainer.{TARGET} = {TARGET}
"""


def test_structural_skip_warns_and_never_breaks_the_import() -> None:
    result = run_python(
        CHANGED_SIGNATURE + 'import trl_vlm_fixes\nprint(json.dumps(trl_vlm_fixes.status()["patches"]["mm_realign"]))\n'
    )
    report = last_json(result)
    assert report["state"] == "skipped" and "signature lacks mm_token_type_ids" in report["detail"]
    assert "WARNING trl_vlm_fixes" in result.stderr and "TRL_VLM_FIXES_MM_REALIGN=0" in result.stderr


def test_removed_target_is_skipped() -> None:
    result = run_python("""
        import trl.generation.vllm_generation as vg
        del vg.VLLMGeneration._init_vllm
        import trl_vlm_fixes
        print(json.dumps(trl_vlm_fixes.status()["patches"]["cudagraph"]))
    """)
    report = last_json(result)
    assert report["state"] == "skipped" and "no longer defined" in report["detail"]


def test_strict_mode_raises_when_a_fix_cannot_be_applied() -> None:
    result = run_python(CHANGED_SIGNATURE + "import trl_vlm_fixes", env={"TRL_VLM_FIXES_STRICT": "1"})
    assert result.returncode != 0 and "FixNotApplicableError" in result.stderr
    assert "TRL_VLM_FIXES_STRICT=1" in result.stderr


UPSTREAM_REPUSHES = """
import trl.generation.vllm_generation as vg
def generate(self, prompts, images, num_generations, profiler=None):
    if self.mode == "colocate" and self.enable_sleep_mode and self._llm_weights_sleeping:
        self.sync_weights()
vg.VLLMGeneration.generate = generate
"""


def test_reload_skip_says_it_steps_aside_on_a_trl_that_repushes() -> None:
    """On TRL >= 1.16 (re-push upstream) the fix must say it is not needed; on 1.9.1 it must be applied."""
    result = run_python(
        "import trl_vlm_fixes, trl.generation.vllm_generation\n"
        'print(json.dumps(trl_vlm_fixes.status()["patches"]["reload_skip"]))\n'
    )
    report = last_json(result)
    if upstream_reloads_from_disk():
        assert report["state"] == "applied"
    else:
        assert report["state"] == "not-needed" and "re-pushes discarded weights itself" in report["detail"]
        assert "reload_skip steps aside" in result.stderr


def test_fix_steps_aside_when_upstream_solved_it() -> None:
    result = run_python(
        UPSTREAM_REPUSHES + "import trl_vlm_fixes\n"
        'print(json.dumps(trl_vlm_fixes.status()["patches"]["reload_skip"]))\n'
    )
    report = last_json(result)
    assert report["state"] == "not-needed" and "re-pushes discarded weights itself" in report["detail"]
    assert "steps aside" in result.stderr


def test_one_info_summary_and_no_prints() -> None:
    result = run_python("import trl_vlm_fixes")
    assert result.stdout == ""
    infos = [line for line in result.stderr.splitlines() if line.startswith("INFO trl_vlm_fixes")]
    assert len(infos) == 1 and "mm_realign=" in infos[0]


def test_cli_json() -> None:
    result = run_python("", args=["-m", "trl_vlm_fixes", "--json"])
    report = json.loads(result.stdout)
    assert result.returncode == 0
    assert {"version", "versions", "validated", "patches"} <= set(report)
    assert set(report["versions"]) == {"trl", "vllm", "transformers", "torch"}
    assert report["validated"] == {"trl": "1.9.1", "vllm": "0.25.1"}
    for name in ("mm_realign", "reload_skip", "cudagraph"):
        assert report["patches"][name]["state"] in {"applied", "disabled", "skipped", "not-needed"}
        assert report["patches"][name]["detail"]


# The CLI's table and --strict exit code are the plugin's own rendering of status(): validated stack only (CI time).
# The states the newest TRL gives are checked in-process on both stacks
# (test_revert_restores_the_exact_objects_then_apply_again against helpers.expected_states) and through the real CLI
# there (test_cli_json).
@pytest.mark.stack_independent
def test_cli_table_and_strict_exit_code() -> None:
    # the table, with one fix disabled on purpose (not a failure under --strict) and the others' switches named
    disabled = run_python("", env={"TRL_VLM_FIXES_CUDAGRAPH": "0"}, args=["-m", "trl_vlm_fixes", "--strict"])
    assert disabled.returncode == 0 and "mm_realign" in disabled.stdout, disabled.stderr[-3000:]
    assert "TRL_VLM_FIXES_MM_REALIGN=0" in disabled.stdout
    skipped = run_python(
        "import runpy\n"
        + CHANGED_SIGNATURE
        + "sys.argv = ['trl_vlm_fixes', '--strict']\nrunpy.run_module('trl_vlm_fixes', run_name='__main__')"
    )
    assert skipped.returncode == 1 and "skipped" in skipped.stdout


@pytest.mark.stack_independent  # the plugin's counters on torch tensors (torch 2.14.1 on every stack): no TRL code
def test_metric_counters_stay_bounded_and_exact() -> None:
    """Counting sums as it goes: one value per counter however many steps pass before (or without) a log."""
    import torch

    from trl_vlm_fixes import metrics

    class Owner:
        pass

    owner = Owner()
    for step in range(10_000):
        metrics.count(owner, counters.MM_REALIGNED_ROWS, torch.tensor(step % 3))
        metrics.count(owner, counters.WEIGHT_REPUSHES, 1)
    stored = metrics._counters.get(owner)
    assert stored is not None
    assert set(stored) == {counters.MM_REALIGNED_ROWS.name, counters.WEIGHT_REPUSHES.name}
    assert all(not isinstance(value, list) and getattr(value, "ndim", 0) == 0 for value in stored.values())
    assert metrics.drain(owner) == {
        counters.MM_REALIGNED_ROWS.name: float(sum(s % 3 for s in range(10_000))),
        counters.WEIGHT_REPUSHES.name: 10_000.0,
    }
    assert metrics.drain(owner) == {}


def test_two_engines_built_at_once_each_get_the_arguments_and_no_global_is_touched(
    make_generation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads inside TRL's LLM(...) at the same moment: the module's LLM is never rebound, both get the mode."""
    import threading

    import trl.generation.vllm_generation as vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM

    both_inside = threading.Barrier(2, timeout=60)
    globals_seen: list[Any] = []

    class SlowEngine(StandInLLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            globals_seen.append(vllm_generation.__dict__.get("LLM"))
            both_inside.wait()  # both constructions are in flight now
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(vllm_generation, "LLM", SlowEngine, raising=False)
    monkeypatch.setenv("TRL_VLM_FIXES_CUDAGRAPH_MODE", "PIECEWISE")  # a pinned mode: an argument both engines must get
    trl_vlm_fixes.revert()
    trl_vlm_fixes.apply()
    engines: list[Any] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            engines.append(make_generation(engine_class=SlowEngine).llm)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert len(engines) == 2 and all(
        e.init_kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"} for e in engines
    )
    assert globals_seen == [SlowEngine, SlowEngine]  # nobody swapped the module global, not even for a moment
    monkeypatch.delenv("TRL_VLM_FIXES_CUDAGRAPH_MODE")
    trl_vlm_fixes.revert()
    trl_vlm_fixes.apply()  # the settings as the environment gives them again
    assert vllm_generation.__dict__.get("LLM") is SlowEngine


def test_status_says_skipped_when_nothing_reached_the_engine_constructor(tiny_model_dir: Any, processor: Any) -> None:
    """An engine built without TRL's LLM(...) call (a drifted TRL): the fix must not keep saying `applied`."""
    import trl.generation.vllm_generation as vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.rollout_schedule import build_generation

    innermost = vars(vllm_generation.VLLMGeneration)["_init_vllm"]
    while type(innermost.__wrapped__) is not types.FunctionType:  # below every fix's wrapper (type(): proxies lie)
        innermost = innermost.__wrapped__
    original = innermost.__wrapped__

    def drifted_init(self: Any) -> None:  # builds the engine under another name
        self.llm = StandInLLM(self.model.name_or_path)

    try:
        innermost.__wrapped__ = drifted_init
        assert trl_vlm_fixes.status()["patches"]["cudagraph"]["state"] == "applied"
        build_generation(tiny_model_dir, processor)
    finally:
        innermost.__wrapped__ = original
    patch = trl_vlm_fixes.status()["patches"]["cudagraph"]
    assert patch["state"] == "skipped" and "nothing was injected" in patch["detail"]
    trl_vlm_fixes.revert()
    trl_vlm_fixes.apply()
    assert trl_vlm_fixes.status()["patches"]["cudagraph"]["state"] == "applied"


def test_engine_builder_guard_is_structural(tmp_path: Any) -> None:

    from trl_vlm_fixes.engine_args import _engine_build_problem

    source = (
        "import vllm\nLLM = None\nclass A:\n    def spaced(self):\n        self.llm = LLM (\n            model='m')\n"
        "    def text_only(self):\n        return 'LLM(model)'\n"
        "    def attribute(self):\n        self.llm = vllm.LLM()\n"
    )
    with module_from_source(tmp_path, "drifted_builders", source) as module:
        assert _engine_build_problem(module.A.spaced) is None
        assert "no longer builds" in (_engine_build_problem(module.A.text_only) or "")
        assert "no longer builds" in (_engine_build_problem(module.A.attribute) or "")  # we could not inject there


# --- the engine-arguments mechanism and trainer start (engine_args.py, trainer_start.py) -------------------------


def test_non_gdn_model_engine_is_built_exactly_as_upstream(make_text_generation: Any, caplog: Any) -> None:
    with caplog.at_level("INFO", logger="trl_vlm_fixes"):
        with_fixes = dict(make_text_generation().llm.init_kwargs)
    trl_vlm_fixes.revert()
    try:
        upstream = dict(make_text_generation().llm.init_kwargs)
    finally:
        trl_vlm_fixes.apply()
    assert with_fixes == upstream and "compilation_config" not in with_fixes
    lines = [r.getMessage() for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]
    assert len(lines) == 1 and "exactly as upstream" in lines[0] and "no Gated-DeltaNet layers" in lines[0]
    assert ("cudagraph and gdn_prefill step aside" if gdn_prefill_acts() else "cudagraph steps aside") in lines[0]


def test_engine_settings_line_is_info_shown_once_the_plugins_logger_is_at_info(tiny_model_dir: Path) -> None:
    """A healthy engine's line is INFO: without any logging setup Python's last-resort handler shows WARNINGs only, so
    it is not shown; with the plugin's logger at INFO (and a handler) it is, once per engine."""
    code = f"""
import logging, os, sys
sys.modules["vllm"] = None
import trl_vlm_fixes
from transformers import AutoProcessor
from trl_vlm_fixes.selftest.rollout_schedule import build_generation
processor = AutoProcessor.from_pretrained({str(tiny_model_dir)!r})
build_generation({str(tiny_model_dir)!r}, processor)
print("-- the plugin's logger at INFO --", file=sys.stderr, flush=True)
logging.basicConfig(format="%(levelname)s %(message)s")
logging.getLogger("trl_vlm_fixes").setLevel(logging.INFO)
build_generation({str(tiny_model_dir)!r}, processor)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], env=environment_without_switches(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    unset, at_info = result.stderr.split("-- the plugin's logger at INFO --")
    assert "built the colocated vLLM engine" not in unset
    lines = [line for line in at_info.splitlines() if "built the colocated vLLM engine" in line]
    assert len(lines) == 1 and lines[0].startswith("INFO trl_vlm_fixes: VLLMGeneration built the colocated vLLM engine")
    assert (
        "cudagraph_mode=vLLM's own (not protected: no GRPO/RLOO trainer under the watchdog builds this engine"
        in lines[0]
    )
    assert ("gdn_prefill_backend=triton (" in lines[0]) == gdn_prefill_acts()


def test_a_healthy_engine_build_logs_at_info_and_a_missed_argument_still_warns(
    make_generation: Any, tiny_model_dir: Any, processor: Any, caplog: Any
) -> None:
    """Issue 46: every fix that acts got its arguments and vLLM built what they ask: the engine line is INFO and
    engine_args says nothing at WARNING. An engine built where the fixes' arguments never reached its constructor (a
    drifted TRL) gets no engine line and one WARNING per fix that should have acted."""
    import trl.generation.vllm_generation as vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.rollout_schedule import build_generation

    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        make_generation()
    records = [r for r in caplog.records if r.name == "trl_vlm_fixes.engine_args"]
    [line] = [r for r in records if "built the colocated vLLM engine" in r.getMessage()]
    assert line.levelno == logging.INFO and "vLLM built: " in line.getMessage()
    assert "cudagraph_mode=vLLM's own" in line.getMessage()
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []

    innermost = vars(vllm_generation.VLLMGeneration)["_init_vllm"]
    while type(innermost.__wrapped__) is not types.FunctionType:  # below every fix's wrapper (type(): proxies lie)
        innermost = innermost.__wrapped__
    original = innermost.__wrapped__

    def drifted_init(self: Any) -> None:  # builds the engine under another name: the arguments are missed
        self.llm = StandInLLM(self.model.name_or_path)

    caplog.clear()
    try:
        innermost.__wrapped__ = drifted_init
        with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
            build_generation(tiny_model_dir, processor)
    finally:
        innermost.__wrapped__ = original
        trl_vlm_fixes.revert()
        trl_vlm_fixes.apply()
    records = [r for r in caplog.records if r.name == "trl_vlm_fixes.engine_args"]
    assert not [r for r in records if "built the" in r.getMessage()]
    missed = [r for r in records if "nothing was injected" in r.getMessage()]
    assert {r.levelno for r in missed} == {logging.WARNING}
    assert "trl_vlm_fixes: cudagraph: VLLMGeneration built an engine without going through LLM(...)" in [
        r.getMessage().split(" where ")[0] for r in missed
    ]


def test_server_engine_is_known_by_trl_file_whatever_its_module_is_called(
    tiny_model_dir: Path, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's vllm_serve.py code run as `__main__` (python -m) or `__mp_main__` (a spawned worker) gets the arguments;
    a vllm.LLM built anywhere else is left exactly as upstream, without a line."""
    pytest.importorskip("vllm")
    if not server_engine_build_problem_in_llm_worker():
        pytest.skip("this TRL's vllm-serve execs vLLM's own server: the wrapper steps aside (test_launcher.py)")
    import trl.scripts.vllm_serve as vllm_serve
    import vllm.entrypoints.llm as llm_module

    layer = vars(llm_module.LLM)["__init__"]
    while type(layer.__wrapped__) is not types.FunctionType:  # below every fix's wrapper (type(): proxies lie)
        layer = layer.__wrapped__
    received: list[dict[str, Any]] = []
    monkeypatch.setattr(layer, "__wrapped__", lambda self, *args, **kwargs: received.append(kwargs))
    worker = "def llm_worker(model):\n    from vllm import LLM\n    LLM(model=model)\n"
    with caplog.at_level("INFO", logger="trl_vlm_fixes"):
        for name in ("__main__", "__mp_main__"):
            namespace: dict[str, Any] = {"__name__": name}
            exec(compile(worker, vllm_serve.__file__, "exec"), namespace)
            namespace["llm_worker"](str(tiny_model_dir))
        llm_module.LLM(model=str(tiny_model_dir))  # a user's own engine, in the same process
    backend = "triton" if gdn_prefill_acts() else None
    assert [kwargs.get("gdn_prefill_backend") for kwargs in received] == [backend, backend, None]
    assert [kwargs.get("compilation_config") for kwargs in received] == [None] * 3  # vLLM's own mode: no hang known
    lines = [r.getMessage() for r in caplog.records if "built the" in r.getMessage()]
    server_line = (
        "trl_vlm_fixes: trl vllm-serve built the vLLM engine with cudagraph_mode=vLLM's own (not protected: trl "
        "vllm-serve reads no trainer's output_dir"
    )
    assert len(lines) == 2 and all(line.startswith(server_line) for line in lines)


def test_trainer_start_shows_every_final_state_once(make_trainer: Any, caplog: Any, monkeypatch: Any) -> None:
    from trl_vlm_fixes import trainer_start

    monkeypatch.setattr(trainer_start, "_announced", False)
    with caplog.at_level("INFO", logger="trl_vlm_fixes"):  # INFO in a healthy run
        make_trainer("grpo")
        make_trainer("rloo")
    lines = [r.getMessage() for r in caplog.records if "python -m trl_vlm_fixes for details" in r.getMessage()]
    assert len(lines) == 1 and "pending" not in lines[0]
    for name in trl_vlm_fixes.status()["patches"]:
        assert f"{name}=" in lines[0]
    assert "watchdog=applied (600 s)" in lines[0]


# --- the Python API, the declarations, the shape of a fix --------------------------------------------------------


def test_the_python_api_wins_over_the_environment_and_reverts_one_fix() -> None:
    report = last_json(
        run_python(
            """
        import trl_vlm_fixes, trl.trainer.grpo_trainer, trl.generation.vllm_generation
        def states():
            return {k: v["state"] for k, v in trl_vlm_fixes.status()["patches"].items()}
        out = {"env": states()}
        trl_vlm_fixes.apply(watchdog=False, cudagraph={"mode": "NONE"}, vision_token_guard={"ban": "off"})
        from trl_vlm_fixes import registry
        out["api"] = states()
        out["mode"] = registry.value("cudagraph", "mode")
        out["ban"] = registry.value("vision_token_guard", "ban")
        trl_vlm_fixes.revert("mm_realign")
        out["reverted_one"] = states()
        layer, modules = vars(trl.trainer.grpo_trainer.GRPOTrainer)["_get_per_token_logps_and_entropies"], []
        while hasattr(layer, "_self_wrapper"):  # a shared method's core wrapper: the hooks it chains
            hooks = getattr(layer._self_wrapper, "hooks", None)
            modules += [h.wrapper.__module__ for h in hooks] if hooks is not None else [layer._self_wrapper.__module__]
            layer = layer.__wrapped__
        out["realign_wrapped"] = "trl_vlm_fixes.patches.mm_realign" in modules
        trl_vlm_fixes.revert(); trl_vlm_fixes.apply()
        out["kept"] = states()
        trl_vlm_fixes.apply(mm_realign=True, watchdog=True)
        out["back"] = states()
        errors = []
        for bad in ({"cudagraph": {"mode": "SOMETIMES"}}, {"cudagraph": {"modes": "NONE"}}, {"nosuchfix": True}):
            try:
                trl_vlm_fixes.apply(**bad)
            except ValueError as error:
                errors.append(str(error))
        out["errors"] = errors
        out["after_errors"], out["mode_after"] = states(), registry.value("cudagraph", "mode")
        trl_vlm_fixes.apply()  # the refused values were never kept
        print(json.dumps(out))
        """,
            env={"TRL_VLM_FIXES_CUDAGRAPH_MODE": "FULL", "TRL_VLM_FIXES_WATCHDOG": "on"},
            with_vllm=True,
        )
    )
    assert report["env"]["watchdog"] == "applied" and report["api"]["watchdog"] == "disabled"
    assert report["mode"] == "NONE" and report["ban"] is False  # the API's value, not TRL_VLM_FIXES_CUDAGRAPH_MODE
    assert report["reverted_one"]["mm_realign"] == "disabled" and not report["realign_wrapped"]
    assert report["reverted_one"]["prompt_parity"] == "applied"  # the others stay applied
    assert report["kept"]["mm_realign"] == "disabled" and report["kept"]["watchdog"] == "disabled"  # kept by apply()
    assert report["back"] == report["env"]
    assert "TRL_VLM_FIXES_CUDAGRAPH_MODE='SOMETIMES'" in report["errors"][0] and "PIECEWISE" in report["errors"][0]
    assert "has no setting ['modes']" in report["errors"][1] and "['mode']" in report["errors"][1]
    assert "no fix of that name" in report["errors"][2]
    assert report["after_errors"] == report["back"] and report["mode_after"] == "NONE"  # a refused call changes nothing


@pytest.mark.stack_independent  # ARCHITECTURE.md against the plugin's own source: no TRL/vLLM code
def test_the_worked_example_in_architecture_is_a_real_declaration() -> None:
    from trl_vlm_fixes.patches import gdn_prefill

    page = (Path(__file__).parents[1] / "ARCHITECTURE.md").read_text()
    example = page.split("The worked example is `patches/gdn_prefill.py`", 1)[1].split("```python\n", 1)[1]
    example = example.split("```", 1)[0]
    assert example.strip() in inspect.getsource(gdn_prefill)


EXAMPLE_FIX = '''
"""example_fix: added the way ARCHITECTURE.md says (a test's fix)."""

from __future__ import annotations

from typing import Any

from .. import metrics
from ..declaration import Counter, Fix, on_trainers
from ..switches import boolean

LOUD = boolean("loud", "TRL_VLM_FIXES_EXAMPLE_FIX_LOUD", False)
CALLS = Counter("trl_vlm_fixes/example_calls")


def log_wrapper(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    metrics.count(instance, CALLS, 1)
    return wrapped(*args, **kwargs)


FIX = Fix(
    name="example_fix",
    summary="an example",
    packages=("trl",),
    targets=on_trainers({"_get_train_sampler": log_wrapper}),
    settings=(LOUD,),
    counters=(CALLS,),
    selftest="trl_vlm_fixes.selftest.checks.example_fix:check",
)
'''

EXAMPLE_CHECK = '''
"""example_fix's self-test check (a test's fix): in the harness, importing what it needs of its fix."""

from __future__ import annotations

from ...patches.example_fix import LOUD
from ...registry import value
from ..runner import CheckResult, SelftestContext


def check(context: SelftestContext, family: str) -> CheckResult:
    return CheckResult("applied", True, bool(value("example_fix", LOUD.key)) or True, 0.0, "example")
'''


# How far a declaration reaches (switch, settings, status, API, counters, self-test, CI's count) is the plugin's own
# code: validated stack only (CI time). The real fixes' declarations meet the newest TRL in every other test here.
@pytest.mark.stack_independent
def test_a_fix_added_as_architecture_says_touches_three_files_of_code(tmp_path: Path) -> None:
    """A copy of the package gets a fix the way ARCHITECTURE.md says (its module, one line in ALL_FIXES, its check in
    the self-test's ``checks/``): its switch, setting validation, status, the API, its counter summed over ranks, the
    self-test (the check its declaration names resolves; the plugin's import loads no harness), the tests' expected
    states and CI's count all pick it up with nothing else touched."""
    import shutil

    package = tmp_path / "trl_vlm_fixes"
    shutil.copytree(Path(trl_vlm_fixes.__file__).parent, package)
    (package / "patches" / "example_fix.py").write_text(EXAMPLE_FIX)
    (package / "selftest" / "checks" / "example_fix.py").write_text(EXAMPLE_CHECK)
    listing = package / "patches" / "__init__.py"
    text = listing.read_text()
    text = text.replace("from . import (\n", "from . import (\n    example_fix,\n")
    head = "ALL_FIXES: tuple[Fix, ...] = (\n"  # the new fix first: the report order is all ALL_FIXES says
    assert head in text
    listing.write_text(text.replace(head, head + "    example_fix.FIX,\n"))
    probe = f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r}); sys.path.insert(1, {str(Path(__file__).parent)!r})
        import trl_vlm_fixes, trl.trainer.grpo_trainer
        assert trl_vlm_fixes.__file__.startswith({str(tmp_path)!r})
        from trl_vlm_fixes import metrics
        from trl_vlm_fixes.patches import ALL_FIXES
        from helpers import expected_states
        out = {{"state": trl_vlm_fixes.status()["patches"]["example_fix"]["state"],
               "switch": trl_vlm_fixes.status()["patches"]["example_fix"]["switch"],
               "counted": [c.name for c in metrics.declared()], "fixes": len(ALL_FIXES),
               "expected": expected_states().get("example_fix"),
               "harness": [m for m in sys.modules if m.startswith("trl_vlm_fixes.selftest")]}}
        from trl_vlm_fixes.selftest.runner import resolve_check, selected
        out["selftest"] = "example_fix" in selected(None) and resolve_check("example_fix").__module__
        trl_vlm_fixes.apply(example_fix=False)
        out["api"] = trl_vlm_fixes.status()["patches"]["example_fix"]["state"]
        print(json.dumps(out))
    """
    report = last_json(run_python(probe, with_vllm=True))
    assert report["state"] == "applied" and report["switch"] == "TRL_VLM_FIXES_EXAMPLE_FIX"
    assert "trl_vlm_fixes/example_calls" in report["counted"] and report["expected"] == "applied"
    assert report["selftest"] == "trl_vlm_fixes.selftest.checks.example_fix" and report["harness"] == []
    assert report["api"] == "disabled"
    assert report["fixes"] == len(__import__("trl_vlm_fixes.patches").patches.ALL_FIXES) + 1
    bad = run_python(probe, env={"TRL_VLM_FIXES_EXAMPLE_FIX_LOUD": "maybe"}, with_vllm=True)
    assert bad.returncode != 0 and "TRL_VLM_FIXES_EXAMPLE_FIX_LOUD='maybe'" in bad.stderr
    off = last_json(run_python(probe, env={"TRL_VLM_FIXES_EXAMPLE_FIX": "0"}, with_vllm=True))
    assert off["state"] == "disabled"


def test_a_fix_that_does_not_act_for_the_trainer_says_stepped_aside(make_trainer: Any, caplog: Any) -> None:
    """use_vllm off: sampling_parity and the engine fixes have nothing to act on for this trainer; status and the
    trainer-start line say so with the reason, not "applied"."""
    from trl_vlm_fixes import trainer_start

    trainer_start._announced = False
    with caplog.at_level("INFO", logger="trl_vlm_fixes"):
        make_trainer("grpo")
    patches = trl_vlm_fixes.status()["patches"]
    assert patches["sampling_parity"]["state"] == "stepped-aside"
    assert "use_vllm is off" in patches["sampling_parity"]["detail"]
    assert patches["mm_realign"]["state"] == "applied"  # the tiny Qwen3.5 is a proven family
    record = next(r for r in caplog.records if "at trainer start" in r.getMessage())
    assert record.levelname == "INFO"  # a healthy run: nothing to warn about
    line = record.getMessage()
    assert "sampling_parity=stepped-aside (use_vllm is off" in line and "mm_realign=applied" in line
