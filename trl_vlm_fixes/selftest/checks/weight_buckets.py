"""``weight_buckets``'s self-test check: TRL's colocated weight push into vLLM's real model class, calls counted.

The helpers here (an engine and a gather that count, a push read back parameter by parameter) also serve the fix's
tests and ``benchmarks/weight_push_cost.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..runner import CheckResult, SelftestContext, off_then_on


class CountingEngine:
    """What TRL reaches of a colocated ``vllm.LLM`` while it pushes (``llm_engine.model_executor.driver_worker.
    model_runner.model.load_weights`` and ``reset_prefix_cache``), around vLLM's real model: each ``load_weights``
    call is recorded with the names it carried, then handed to vLLM's own."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[list[str]] = []
        self.prefix_cache_resets = 0
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker))

    def load_weights(self, weights: Any) -> Any:
        weights = list(weights)
        self.calls.append([name for name, _ in weights])
        return self.model.load_weights(weights)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        self.prefix_cache_resets += 1
        return True


class CountingGathers:
    """TRL's ``DistributedBackend`` (``generation._dist``) with every ``gather_params`` call recorded (its
    parameters), then made by the backend itself."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.calls: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    @contextmanager
    def gather_params(self, params: Any) -> Iterator[None]:
        params = list(params)
        self.calls.append(params)
        with self.backend.gather_params(params):
            yield


@dataclass
class Pushed:
    """One push: the engine's parameters after it (by vLLM name), its load_weights calls and gathers."""

    parameters: dict[str, Any]
    calls: list[list[str]]
    gathers: int
    trainer_parameters: int

    def mismatches(self, other: Pushed) -> list[str]:
        import torch

        names = sorted(set(self.parameters) | set(other.parameters))
        return [
            name
            for name in names
            if name not in self.parameters
            or name not in other.parameters
            or not torch.equal(self.parameters[name], other.parameters[name])
        ]


@dataclass
class PushSetup:
    """TRL's real ``VLLMGeneration`` (colocate, no sleep mode) whose engine is vLLM's real model class on the CPU."""

    generation: Any
    engine: CountingEngine
    vllm: Any  # selftest.vllm_model.VllmModel
    gathers: CountingGathers = field(init=False)

    def __post_init__(self) -> None:
        self.gathers = CountingGathers(self.generation._dist)
        self.generation._dist = self.gathers

    def push(self) -> Pushed:
        """One ``sync_weights`` into an engine whose every parameter was NaN (a parameter no push reaches fails)."""
        import torch

        from ..vllm_model import cpu_platform

        with torch.no_grad():
            for parameter in self.vllm.model.parameters():
                parameter.fill_(float("nan"))
        self.engine.calls.clear()
        self.gathers.calls.clear()
        with cpu_platform():
            self.generation.sync_weights()
        return Pushed(
            {name: tensor.clone() for name, tensor in self.vllm.parameters().items()},
            [list(call) for call in self.engine.calls],
            len(self.gathers.calls),
            sum(1 for _ in self.generation.model.parameters()),
        )


def trained_model(model_dir: str | Path, seed: int = 0) -> Any:
    """The checkpoint's transformers model (float32) after one random step on every parameter: what a push sends
    differs from what vLLM loaded."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=0.05)
    return model


def push_setup(model_dir: str | Path, processor: Any, vllm: Any = None, model: Any = None) -> PushSetup:
    """vLLM's model class for ``model_dir`` (experts on Triton, as vLLM picks on Hopper; or ``vllm``) as the engine
    TRL's own ``VLLMGeneration`` builds, its trainer model ``model`` (default: ``trained_model``)."""
    from ..rollout_schedule import build_generation
    from ..vllm_model import build_vllm_model

    vllm = vllm if vllm is not None else build_vllm_model(model_dir)
    engine = CountingEngine(vllm.model)
    generation = build_generation(
        None,
        processor,
        enable_sleep_mode=False,
        engine_class=lambda **_: engine,
        model=model if model is not None else trained_model(model_dir),
    )
    return PushSetup(generation, engine, vllm)


def check(context: SelftestContext, family: str) -> CheckResult:
    """TRL's colocated push of the family's tiny model into vLLM's real class: how many load_weights calls and
    gathers per push, and are the engine's weights after it bit for bit those of TRL's per-parameter push?"""
    from transformers import AutoConfig

    from ...moe_backend import fused_expert_layout_problem
    from ...patches.weight_buckets import aside_reason
    from ...registry import active
    from ..vllm_engine import VllmModelUnavailable, release

    model_dir = context.model_dir(family)
    if layout := fused_expert_layout_problem(AutoConfig.from_pretrained(model_dir)):
        return CheckResult(active().fix_state("weight_buckets")[0], None, None, 0.0, f"{family}: {layout}")
    try:
        setup = push_setup(model_dir, context.processor(family))
        upstream: list[Pushed] = []

        def measure() -> Pushed:
            return setup.push()

        def bug(pushed: Pushed) -> tuple[bool, str]:
            upstream.append(pushed)
            count = pushed.trainer_parameters
            return len(pushed.calls) == count, (
                f"fix off: {len(pushed.calls)} load_weights calls and {pushed.gathers} gathers for {count} parameters"
            )

        def fix(pushed: Pushed) -> tuple[bool | None, str]:
            if reason := aside_reason(setup.generation):
                return None, f"fix on: steps aside ({reason})"
            wrong = pushed.mismatches(upstream[0]) if upstream else ["(no push with the fix off)"]
            fewer = len(pushed.calls) < pushed.trainer_parameters and pushed.gathers == len(pushed.calls)
            return fewer and not wrong, (
                f"fix on: {len(pushed.calls)} load_weights call(s) and {pushed.gathers} gather(s); "
                f"{len(pushed.parameters) - len(wrong)}/{len(pushed.parameters)} engine parameters as TRL's push"
            )

        return off_then_on("weight_buckets", measure, bug, fix)
    except VllmModelUnavailable as error:
        return CheckResult(active().fix_state("weight_buckets")[0], None, None, 0.0, f"{family}: {error}")
    finally:
        release()  # vLLM's world of one rank: a dense and a MoE model need different ones
