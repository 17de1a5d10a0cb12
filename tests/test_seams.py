"""The seams (``trl_vlm_fixes/seams.py``): where several fixes act on one callable, the order is declared once and the
registry follows it whatever the report order (``ALL_FIXES``); the core owns each engine builder with one wrapper that
applies every applied engine fix's declared contribution. No trainer is built: TRL's real methods, wrapped, and TRL's
real ``VLLMGeneration._init_vllm`` on a bare instance with a recording ``LLM``."""

from __future__ import annotations

import importlib
import logging
import random
import traceback
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import Any

import pytest
import wrapt
from helpers import gdn_prefill_acts, server_engine_build_problem_in_llm_worker

import trl_vlm_fixes
from trl_vlm_fixes import engine_args, registry, seams
from trl_vlm_fixes.declaration import Fix, Target
from trl_vlm_fixes.engine_args import EngineContribution
from trl_vlm_fixes.patches import ALL_FIXES
from trl_vlm_fixes.registry import Registry
from trl_vlm_fixes.seams import SeamOrderError

ENGINE_FIXES = tuple(fix.name for fix in ALL_FIXES if fix.engine is not None)


def needed_here(name: str) -> bool:
    """The engine fix is applied on this stack (gdn_prefill is not needed where FlashInfer's old kernel is gone)."""
    return name != "gdn_prefill" or gdn_prefill_acts()


INIT_VLLM = "trl.generation.vllm_generation:VLLMGeneration._init_vllm"
GENERATE = "trl.generation.vllm_generation:VLLMGeneration.generate"


# The wrappers' nesting before seams.py (ALL_FIXES's order, the first innermost), outermost first: seams.py keeps it
# (weight_buckets, newer, replaces TRL's push loop: innermost on sync_weights)
BEFORE_SEAMS = {
    GENERATE: ["watchdog", "wake_reset", "reload_skip", "sampling_parity", "prompt_parity"],
    "trl.generation.vllm_generation:VLLMGeneration.sync_weights": [
        "watchdog",
        "wake_reset",
        "reload_skip",
        "weight_buckets",
    ],
    # scoring_skip (added since) outermost: it reads what sampling_parity made of a loss pass's log-probs
    "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies": [
        "scoring_skip",
        "sampling_parity",
        "mm_realign",
    ],
    # scoring_skip innermost: sampling_parity records the rollout around it
    "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions": [
        "vision_token_guard",
        "sampling_parity",
        "scoring_skip",
    ],
    "trl.trainer.grpo_trainer:GRPOTrainer._generate": ["vision_token_guard", "reload_skip"],
}


def _import_targets() -> None:
    """TRL's modules that hold the shared methods and the engine builders (a target module missing here is left out)."""
    for module in {target.module for fix in ALL_FIXES for target in fix.targets}:
        with suppress(ImportError):
            importlib.import_module(module)


@contextmanager
def registry_of(fixes: Sequence[Fix], choices: dict[str, Any] | None = None) -> Iterator[Registry]:
    """A registry of ``fixes`` (in that report order) applied to the real TRL instead of the process's; afterwards it
    is reverted and dropped, and the process's registry applied again."""
    _import_targets()
    trl_vlm_fixes.revert()
    built = Registry(tuple(fixes))
    try:
        built.apply(choices)
        yield built
    finally:
        built.revert()
        registry._registries.remove(built)
        trl_vlm_fixes.apply()


def _attribute(key: str) -> Any:
    module_name, _, qualname = key.partition(":")
    owner_name, _, attribute = qualname.rpartition(".")
    module = importlib.import_module(module_name)
    return vars(getattr(module, owner_name) if owner_name else module).get(attribute)


def chain(built: Registry, key: str) -> list[str]:
    """The fixes acting on ``key``, outermost (called first) first: on a shared method, the hooks its one core wrapper
    chains (``SeamWrapper``), one entry per fix; elsewhere each wrapper as the fixes it belongs to (``a+b``: one
    wrapper, the core's, shared by the fixes named: an engine builder's)."""
    owners: dict[int, list[str]] = {}
    for patch_key, patched in built._patched.items():
        owners.setdefault(id(patched.wrapper), []).append(patch_key.split("|", 1)[0])
    layers, layer = [], _attribute(key)
    while isinstance(layer, wrapt.FunctionWrapper):
        if id(layer) not in owners:
            layers.append("<not the plugin's>")
        elif isinstance(layer._self_wrapper, registry.SeamWrapper):
            layers.extend(layer._self_wrapper.fixes)
        else:
            layers.append("+".join(sorted(owners[id(layer)])))
        layer = layer.__wrapped__
    return layers


def wrapt_layers(key: str) -> tuple[list[Any], Any]:
    """The ``wrapt`` wrappers on ``key``, outermost first, and what the innermost wraps."""
    layers, layer = [], _attribute(key)
    while isinstance(layer, wrapt.FunctionWrapper):
        layers.append(layer)
        layer = layer.__wrapped__
    return layers, layer


def shared_keys() -> list[str]:
    """Every callable more than one fix declares a target on, in an imported module."""
    import sys

    wrapping: dict[str, set[str]] = {}
    for fix in ALL_FIXES:
        for target in fix.targets:
            if target.module in sys.modules:
                wrapping.setdefault(target.key, set()).add(fix.name)
    return sorted(key for key, names in wrapping.items() if len(names) > 1)


class RecordingLLM:
    """``vllm.LLM`` as TRL's builder calls it: keeps the arguments, builds nothing."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


def build_engine(monkeypatch: pytest.MonkeyPatch, gated_deltanet: bool = True) -> dict[str, Any]:
    """TRL's real ``VLLMGeneration._init_vllm`` (colocate) on a bare instance, its ``LLM`` a recorder: the arguments
    the engine would get."""
    import trl.generation.vllm_generation as vllm_generation

    for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # _init_vllm sets them: put back afterwards
        monkeypatch.setenv(variable, "0" if variable != "WORLD_SIZE" else "1")
    monkeypatch.setattr(vllm_generation, "LLM", RecordingLLM, raising=False)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *a, **k: True)
    generation = vllm_generation.VLLMGeneration.__new__(vllm_generation.VLLMGeneration)
    layers = ["linear_attention", "full_attention"] if gated_deltanet else ["full_attention"]
    config = types.SimpleNamespace(text_config=types.SimpleNamespace(layer_types=layers))
    generation.model = types.SimpleNamespace(name_or_path="tiny", config=config, named_modules=lambda: [])
    generation.accelerator = types.SimpleNamespace(
        num_processes=1, process_index=0, local_process_index=0, is_main_process=True, wait_for_everyone=lambda: None
    )
    for name, value in {
        "mode": "colocate",
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.3,
        "max_model_length": None,
        "max_num_seqs": None,
        "enable_sleep_mode": False,
        "model_impl": "auto",
        "trust_remote_code": False,
    }.items():
        setattr(generation, name, value)
    generation._init_vllm()
    return dict(generation.llm.kwargs)


def engine_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "built the colocated vLLM engine" in r.getMessage()]


def test_the_wrapping_order_is_the_declared_one_whatever_the_report_order(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ALL_FIXES as it is, reversed and shuffled: the same hooks chained the same way on every shared method (the
    order seams.py declares, innermost first), and the same engine contributions in the same order, down to the
    engine's line (which lists the fixes stepping aside in that order)."""
    shuffled = list(ALL_FIXES)
    random.Random(47).shuffle(shuffled)
    seen = []
    for order in (ALL_FIXES, tuple(reversed(ALL_FIXES)), tuple(shuffled)):
        caplog.clear()
        with registry_of(order) as built, caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
            chains = {key: chain(built, key) for key in shared_keys()}
            contributions = {key: [fix.name for fix in built.engine_fixes(key)] for key in seams.ENGINE_BUILDER_KEYS}
            arguments = [build_engine(monkeypatch, gated_deltanet) for gated_deltanet in (False, True)]
        seen.append((chains, contributions, arguments, engine_lines(caplog)))
    assert seen[1] == seen[0] and seen[2] == seen[0]
    chains, contributions, _, lines = seen[0]
    assert GENERATE in chains and INIT_VLLM in chains and len(lines) == 2
    for key, layers in chains.items():
        if key in seams.WRAP_ORDER:  # outermost first: the declared order read from its end
            assert layers[::-1] == [name for name in seams.WRAP_ORDER[key] if name in layers], key
    for key, outermost_first in BEFORE_SEAMS.items():  # the order the fixes had when ALL_FIXES decided it
        assert chains[key] == [name for name in outermost_first if name in chains[key]], key
    assert contributions[INIT_VLLM] == [
        name for name in seams.ENGINE_CONTRIBUTIONS if name in ENGINE_FIXES and needed_here(name)
    ]
    assert chains[INIT_VLLM] == ["+".join(sorted(contributions[INIT_VLLM]))]  # one layer: the core's
    # the contributions' order shows in the line: expert_layout's reason first, as declared
    assert "upstream: expert_layout steps aside" in lines[0] and lines[0].index("expert_layout") < lines[0].index(
        "cudagraph"
    )


def test_one_plugin_wrapper_per_shared_method_around_trls_original() -> None:
    """While the fixes are applied, every shared method carries one wrapt layer, the core's (a ``SeamWrapper``),
    directly around TRL's own function, whatever the number of fixes acting there; reverted, TRL's function is back."""
    with registry_of(ALL_FIXES) as built:
        shared = [key for key in shared_keys() if key in seams.WRAP_ORDER and built._seams.get(key) is not None]
        assert GENERATE in shared
        found = {}
        for key in shared:
            layers, innermost = wrapt_layers(key)
            found[key] = innermost
            assert len(layers) == 1, (key, chain(built, key))
            assert isinstance(layers[0]._self_wrapper, registry.SeamWrapper), key
            assert type(innermost) is types.FunctionType, key  # TRL's own function, no wrapper below the core's
            assert layers[0]._self_wrapper.fixes == tuple(chain(built, key)) and len(chain(built, key)) >= 1, key
        assert len(built._seams[GENERATE].hooks) > 1  # several fixes, one layer
        built.revert()
        assert all(_attribute(key) is function for key, function in found.items())


def test_reverting_a_fix_in_the_middle_of_a_chain_keeps_the_others_acting_in_order() -> None:
    """Five recording fixes on VLLMGeneration.generate, given in a shuffled report order: called in the declared order
    (outermost first) down to TRL's own generate; each hook's ``wrapped`` shows what a wrapt layer below would have
    (TRL's bound method's name, ``__func__``, ``__self__``, signature). Reverting the middle one takes its hook out
    and leaves the others acting in order, down to TRL's function; applying it again puts it back in its place."""
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration

    from trl_vlm_fixes.call_arguments import bind

    module, _, qualname = GENERATE.partition(":")
    declared = list(reversed(seams.WRAP_ORDER[GENERATE]))  # outermost (called first) first
    acted: list[str] = []
    seen: dict[str, Any] = {}

    def hook(name: str) -> Callable[..., Any]:
        def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            acted.append(name)
            seen[name] = (wrapped, instance, bind(wrapped, args, kwargs).arguments)
            return wrapped(*args, **kwargs)

        return wrapper

    fixes = [_fix(name, Target(module, qualname, hook(name))) for name in declared]
    random.Random(47).shuffle(fixes)
    middle = declared[len(declared) // 2]

    def generate() -> None:
        """A bare VLLMGeneration: TRL's own generate is reached when its first line reads ``self.accelerator``."""
        acted.clear()
        seen.clear()
        generation = VLLMGeneration.__new__(VLLMGeneration)
        with pytest.raises(AttributeError, match="accelerator") as error:
            generation.generate([[1, 2]], None, num_generations=1)
        frames = [frame.f_code for frame, _ in traceback.walk_tb(error.value.__traceback__)]
        assert frames[-1] is original.__code__  # raised in TRL's own generate
        for wrapped, instance, arguments in seen.values():
            assert instance is generation and wrapped.__self__ is generation and wrapped.__func__ is original
            assert wrapped.__name__ == "generate" and inspect.unwrap(wrapped) == original.__get__(generation)
            assert str(inspect.signature(wrapped)) == str(inspect.signature(original.__get__(generation)))
            assert dict(arguments) == {"prompts": [[1, 2]], "images": None, "num_generations": 1}

    with registry_of(fixes) as built:
        layers, original = wrapt_layers(GENERATE)
        assert len(layers) == 1 and type(original) is types.FunctionType
        generate()
        assert acted == chain(built, GENERATE) == declared
        built.revert([middle])
        layers, innermost = wrapt_layers(GENERATE)
        assert len(layers) == 1 and innermost is original
        generate()
        assert acted == chain(built, GENERATE) == [name for name in declared if name != middle]
        assert built.fix_state(middle)[0] == "disabled"
        built.apply({middle: True})
        generate()
        assert acted == chain(built, GENERATE) == declared
        built.revert([name for name in declared if name != middle])
        generate()  # one hook left: still the core's wrapper, and TRL's function below it
        assert acted == chain(built, GENERATE) == [middle] and len(wrapt_layers(GENERATE)[0]) == 1
        built.revert([middle])
        assert wrapt_layers(GENERATE) == ([], original)  # no hook left: no wrapper


def _fix(name: str, *targets: Target, engine: EngineContribution | None = None) -> Fix:
    return Fix(name=name, summary="a test's fix", packages=("trl",), targets=targets, engine=engine)


def _passthrough(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    return wrapped(*args, **kwargs)


def _nothing(kwargs: dict[str, Any], build: Any) -> None:
    return None


@pytest.mark.stack_independent  # the registry's check of the declarations, before anything is wrapped: no TRL code
def test_a_fix_on_a_seam_without_a_declared_place_is_refused_naming_what_to_add() -> None:
    module, _, qualname = GENERATE.partition(":")
    registries = list(registry._registries)
    refused = {
        "shared": _fix("late_fix", Target(module, qualname, _passthrough)),
        "undeclared": _fix("late_fix", Target(module, "VLLMGeneration.new_method", _passthrough)),
        "builder": _fix("late_fix", Target(*INIT_VLLM.split(":"), _passthrough)),
        "engine": _fix("late_fix", engine=EngineContribution(_nothing, lambda build: True, lambda: None)),
    }
    messages = {}
    for case, fix in refused.items():
        extra = (fix, _fix("other_fix", *fix.targets)) if case == "undeclared" else (fix,)
        with pytest.raises(SeamOrderError) as error:
            Registry((*ALL_FIXES, *extra))
        messages[case] = str(error.value)
    assert registry._registries == registries  # refused before a registry exists: nothing hooked, nothing wrapped
    assert f"fix late_fix wraps {GENERATE}" in messages["shared"]
    assert f"add 'late_fix' to WRAP_ORDER[{GENERATE!r}]" in messages["shared"] and "seams.py" in messages["shared"]
    undeclared = f"{module}:VLLMGeneration.new_method is wrapped by late_fix, other_fix"
    assert undeclared in messages["undeclared"] and "declares no order" in messages["undeclared"]
    assert f"fix late_fix wraps {INIT_VLLM} itself" in messages["builder"]
    assert "engine=EngineContribution(...)" in messages["builder"]
    assert "add 'late_fix' there" in messages["engine"] and "ENGINE_CONTRIBUTIONS" in messages["engine"]
    # a fix named in a seam's order but not registered (weight_buckets, absent from a list without it) is passed over
    without = tuple(fix for fix in ALL_FIXES if fix.name not in ("weight_buckets", "reload_skip", "cudagraph"))
    Registry(without)
    registry._registries.pop()


def test_one_plugin_wrapper_per_engine_builder_however_many_engine_fixes() -> None:
    """Every subset of the engine fixes switched on: each engine builder carries one wrapper of the plugin's (none
    where no engine fix is on), and it applies the contributions of those on, in the declared order."""
    for count in range(len(ENGINE_FIXES) + 1):
        for on in (ENGINE_FIXES[:count], ENGINE_FIXES[count:]):
            choices = {name: name in on for name in ENGINE_FIXES}
            with registry_of(ALL_FIXES, choices) as built:
                for key in sorted(seams.ENGINE_BUILDER_KEYS):
                    if _attribute(key) is None:  # its module is absent from this TRL
                        continue
                    if key.endswith(":LLM.__init__") and not server_engine_build_problem_in_llm_worker():
                        continue  # TRL >= 1.11's `trl vllm-serve` execs vLLM's own server: no engine fix acts there
                    applied = [fix.name for fix in built.engine_fixes(key)]
                    assert applied == [name for name in seams.ENGINE_CONTRIBUTIONS if name in on and needed_here(name)]
                    assert chain(built, key) == (["+".join(sorted(applied))] if applied else []), (key, on)


def test_one_engine_fix_off_leaves_the_others_contributions(
    monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None]
) -> None:
    """No relay between the engine fixes: reverting one (or switching it off) stops its contribution alone, whichever
    it is; the others' arguments still reach LLM(...). And engine_args holds no ContextVar."""
    assert not [name for name, value in vars(engine_args).items() if isinstance(value, ContextVar)]
    monkeypatch.setenv("TRL_VLM_FIXES_CUDAGRAPH_MODE", "NONE")
    gdn = gdn_prefill_acts()
    with registry_of(ALL_FIXES) as built:
        both = build_engine(monkeypatch)
        assert both["compilation_config"] == {"cudagraph_mode": "NONE"}
        assert both.get("gdn_prefill_backend") == ("triton" if gdn else None)
        built.revert(["cudagraph"])
        without_cudagraph = build_engine(monkeypatch)
        assert "compilation_config" not in without_cudagraph
        assert without_cudagraph.get("gdn_prefill_backend") == ("triton" if gdn else None)
        assert chain(built, INIT_VLLM) == ["expert_layout+gdn_prefill" if gdn else "expert_layout"]
        built.apply({"cudagraph": True, "gdn_prefill": False})
        without_gdn = build_engine(monkeypatch)
        assert without_gdn["compilation_config"] == {"cudagraph_mode": "NONE"}
        assert "gdn_prefill_backend" not in without_gdn
        states = {name: built.fix_state(name)[0] for name in ENGINE_FIXES}
        assert states == {"cudagraph": "applied", "gdn_prefill": "disabled", "expert_layout": "applied"}
