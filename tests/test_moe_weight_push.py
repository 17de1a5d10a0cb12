"""TRL's colocated weight push of a mixture-of-experts VLM, into vLLM's real model class, read back parameter by
parameter.

The trainer (a tiny Qwen3.5-MoE or Qwen3-VL-MoE, transformers 5's fused expert tensors ``experts.gate_up_proj``
[E, 2I, H] and ``experts.down_proj`` [E, H, I]; with or without LoRA) takes one optimizer-like step, then TRL's own
``VLLMGeneration.sync_weights`` pushes it, tensor by tensor, into vLLM's own model class built on the CPU
(``trl_vlm_fixes.selftest.vllm_model``): exactly ``model_runner.model.load_weights([(name, tensor)])`` of a colocated
engine. Every vLLM parameter is then compared, bit for bit (float32), with

- a second vLLM model that vLLM's own loader built from the trainer's weights written by ``save_pretrained`` (LoRA
  merged by peft's ``merge_and_unload``): what an engine started on the trained checkpoint would hold; and
- for the mixture-of-experts tensors, the documented layout: ``w13_weight[e]`` is the expert's gate rows then its up
  rows (transformers' ``gate_up_proj[e]``), ``w2_weight[e]`` its ``down_proj[e]``, the router ``gate.weight`` and
  Qwen3.5's shared expert (``gate_up_proj`` = gate_proj rows then up_proj rows, ``down_proj``, ``shared_expert_gate``)
  as the trainer has them.

The pushed model is filled with NaN first, so a parameter the push never reaches cannot pass. One test breaks the push
on purpose (an expert tensor transposed, or its gate and up halves swapped: FlashInfer CUTLASS's ``[w3; w1]`` layout)
and checks that exactly that parameter is reported.
"""

from __future__ import annotations

import copy
import importlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

FAMILIES = ("qwen3_5_moe", "qwen3_vl_moe")


def _vllm_model_or_skip(model_dir: Path, load_format: str = "auto") -> Any:
    from trl_vlm_fixes.selftest.vllm_model import VllmModelUnavailable, build_vllm_model

    try:
        return build_vllm_model(model_dir, load_format=load_format)
    except VllmModelUnavailable as error:
        pytest.skip(f"vLLM's model class cannot be built on this machine: {error}")


class _Engine:
    """What TRL reaches of a colocated ``vllm.LLM`` while it pushes: ``llm_engine.model_executor.driver_worker.
    model_runner.model`` (vLLM's real model), and ``reset_prefix_cache`` after the push."""

    def __init__(self, model: Any) -> None:
        runner = SimpleNamespace(model=model)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)))
        self.prefix_cache_resets = 0
        self.built_with: dict[str, Any] = {}

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True


class _Tampered:
    """vLLM's model behind a push that changes one named tensor on its way (to prove the comparison can fail)."""

    def __init__(self, model: Any, name: str, change: Callable[[Any], Any]) -> None:
        self.model, self.name, self.change = model, name, change

    def load_weights(self, weights: Any) -> Any:
        return self.model.load_weights([(n, self.change(t) if n == self.name else t) for n, t in weights])


def _generation(trainer_model: Any, engine: _Engine, processor: Any) -> Any:
    """TRL's real VLLMGeneration in colocate mode, its ``LLM`` the engine above (swapped in for the build only)."""
    from accelerate import Accelerator

    module: Any = importlib.import_module("trl.generation.vllm_generation")
    saved = {name: getattr(module, name, None) for name in ("LLM", "is_vllm_available")}

    def build(**kwargs: Any) -> _Engine:
        engine.built_with = kwargs
        return engine

    module.LLM = build
    module.is_vllm_available = lambda *a, **k: True
    try:
        return module.VLLMGeneration(
            model=trainer_model,
            accelerator=Accelerator(cpu=True),
            processing_class=processor,
            mode="colocate",
            enable_sleep_mode=False,
            max_completion_length=4,
        )
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(module, name)
            else:
                setattr(module, name, value)


def _lora(model: Any, family: str) -> Any:
    """LoRA as a GRPO run would put it: attention (full and, Qwen3.5, Gated-DeltaNet), the shared expert, the vision
    tower's attention, and the routed experts' fused tensors (peft's ``target_parameters``)."""
    from peft import LoraConfig, get_peft_model

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "attn.qkv", "attn.proj"]
    if family == "qwen3_5_moe":
        modules += ["in_proj_qkv", "in_proj_z", "out_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                    "shared_expert.down_proj"]
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=modules,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    return get_peft_model(model, config)


def _optimizer_step(model: Any, seed: int = 0) -> None:
    """One SGD step on a random gradient, on every parameter the optimizer owns (all of them, or LoRA's)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=-0.05)


def _trained_checkpoint(trainer_model: Any, model_dir: Path, out: Path) -> dict[str, Any]:
    """The trainer's weights as a checkpoint (LoRA merged by peft), next to the original tokenizer and processor;
    returns the merged state dict."""
    from peft import PeftModel

    shutil.copytree(model_dir, out)
    merged = copy.deepcopy(trainer_model)
    if isinstance(merged, PeftModel):
        merged = merged.merge_and_unload()
    merged.save_pretrained(out)
    return {name: tensor.detach().clone() for name, tensor in merged.state_dict().items()}


def _moe_layout(expected_state: dict[str, Any], num_layers: int, shared_expert: bool) -> dict[str, Any]:
    """vLLM's mixture-of-experts parameters from the trainer's tensors by the documented layout (no vLLM code)."""
    layout = {}
    for layer in range(num_layers):
        hf = f"model.language_model.layers.{layer}.mlp."
        vllm = f"language_model.model.layers.{layer}.mlp."
        layout[vllm + "experts.routed_experts.w13_weight"] = expected_state[hf + "experts.gate_up_proj"]
        layout[vllm + "experts.routed_experts.w2_weight"] = expected_state[hf + "experts.down_proj"]
        layout[vllm + "gate.weight"] = expected_state[hf + "gate.weight"]
        if shared_expert:
            layout[vllm + "shared_expert.gate_up_proj.weight"] = torch.cat(
                [expected_state[hf + "shared_expert.gate_proj.weight"], expected_state[hf + "shared_expert.up_proj.weight"]]
            )
            layout[vllm + "shared_expert.down_proj.weight"] = expected_state[hf + "shared_expert.down_proj.weight"]
            layout[vllm + "shared_expert_gate.weight"] = expected_state[hf + "shared_expert_gate.weight"]
    return layout


def _mismatches(pushed: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    names = sorted(set(pushed) | set(expected))
    return [n for n in names if n not in pushed or n not in expected or not torch.equal(pushed[n], expected[n])]


@pytest.fixture
def moe_push(family_model_dir: Callable[[str], Path], tmp_path: Path) -> Iterator[Callable[..., dict[str, Any]]]:
    """Run one push; returns what each comparison found."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_vlm_fixes.selftest.vllm_model import cpu_platform

    def run(family: str, peft: bool, tamper: tuple[str, Callable[[Any], Any]] | None = None) -> dict[str, Any]:
        model_dir = family_model_dir(family)
        engine_model = _vllm_model_or_skip(model_dir)  # the engine TRL built on the checkpoint
        trainer = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        text = trainer.config.text_config
        if peft:
            trainer = _lora(trainer, family)
        _optimizer_step(trainer)
        trained_dir = Path(tempfile.mkdtemp(dir=tmp_path)) / "trained"
        reference_state = _trained_checkpoint(trainer, model_dir, trained_dir)
        reference = _vllm_model_or_skip(trained_dir)  # vLLM's own loader on the trained weights

        with torch.no_grad():
            for parameter in engine_model.model.parameters():
                parameter.fill_(float("nan"))  # a parameter the push never reaches cannot pass
        target = engine_model.model if tamper is None else _Tampered(engine_model.model, *tamper)
        engine = _Engine(target)
        generation = _generation(trainer, engine, AutoProcessor.from_pretrained(model_dir))
        with cpu_platform():
            generation.sync_weights()
        assert engine.prefix_cache_resets == 1
        assert engine.built_with["model"] == trainer.name_or_path or peft

        pushed = engine_model.parameters()
        layout = _moe_layout(reference_state, text.num_hidden_layers, family == "qwen3_5_moe")
        return {
            "against_reference": _mismatches(pushed, reference.parameters()),
            "against_layout": _mismatches({n: pushed[n] for n in layout}, layout),
            "moe_parameters": sorted(layout),
            "pushed": pushed,
            "backends": engine_model.moe_backends,
            "reference_differs_from_checkpoint": _mismatches(reference.parameters(), _vllm_model_or_skip(model_dir).parameters()),
        }

    yield run


@pytest.mark.slow
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_vllm_parameter_is_the_trainers(moe_push: Callable[..., dict[str, Any]], family: str, peft: bool) -> None:
    found = moe_push(family, peft)
    assert found["against_reference"] == []
    assert found["against_layout"] == []
    names = found["pushed"]
    assert any(".experts.routed_experts.w13_weight" in n for n in names)
    assert any(n.startswith("visual.") for n in names)
    assert set(found["backends"].values()) == {"CPU"}  # vLLM's CPU backend: weights kept as loaded
    # the step changed what it should: every parameter (full), the LoRA-targeted ones (LoRA), experts included
    changed = set(found["reference_differs_from_checkpoint"])
    w13 = {n for n in names if n.endswith("w13_weight")}
    assert w13 <= changed
    if not peft:
        assert changed == set(names)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change",
    [lambda t: t.transpose(-1, -2).contiguous(), lambda t: torch.cat(t.chunk(2, dim=1)[::-1], dim=1)],
    ids=["transposed", "gate-up-swapped"],
)
def test_a_wrong_expert_layout_is_caught(moe_push: Callable[..., dict[str, Any]], change: Callable[[Any], Any]) -> None:
    found = moe_push("qwen3_5_moe", False, ("model.language_model.layers.1.mlp.experts.gate_up_proj", change))
    broken = ["language_model.model.layers.1.mlp.experts.routed_experts.w13_weight"]
    assert found["against_reference"] == broken
    assert found["against_layout"] == broken
