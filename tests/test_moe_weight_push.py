"""TRL's colocated weight push of a mixture-of-experts VLM into vLLM's real model class, read back parameter by
parameter.

The trainer (a tiny Qwen3.5-MoE or Qwen3-VL-MoE with transformers 5's fused expert tensors ``experts.gate_up_proj``
[E, 2I, H] and ``experts.down_proj`` [E, H, I]; with or without LoRA) takes one optimizer-like step, then TRL's own
``VLLMGeneration.sync_weights`` pushes it, tensor by tensor, into vLLM's own model class built on the CPU
(``trl_vlm_fixes.selftest.vllm_model``): exactly the ``model_runner.model.load_weights([(name, tensor)])`` of a
colocated engine, whose experts run on Triton as vLLM picks on Hopper. Every vLLM parameter is then compared, bit for
bit (float32), with

- a second vLLM model that vLLM's own loader built from the trainer's weights written by ``save_pretrained`` (LoRA
  merged by peft's ``merge_and_unload``): what an engine started on the trained checkpoint holds; and
- for the mixture-of-experts tensors, the documented layout, without vLLM's code: ``w13_weight[e]`` is the expert's
  gate rows then its up rows (transformers' ``gate_up_proj[e]``), ``w2_weight[e]`` its ``down_proj[e]``, the router
  ``gate.weight`` and Qwen3.5's shared expert (``gate_up_proj`` = gate_proj rows then up_proj rows, ``down_proj``,
  ``shared_expert_gate``) as the trainer has them.

The pushed model is filled with NaN first, so a parameter the push never reaches cannot pass. One test breaks the push
on purpose (an expert tensor transposed, or its gate and up halves swapped) and checks that exactly that parameter is
reported; another builds the engine on FlashInfer CUTLASS, whose post-load step swaps ``w13``'s halves: the push is
then silently wrong until that step is re-run on the pushed experts. About 1-3 s per test (first one: vLLM's import).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
pytest.importorskip("peft")

FAMILIES = ("qwen3_5_moe", "qwen3_vl_moe")
W13 = "language_model.model.layers.{}.mlp.experts.routed_experts.w13_weight"


@pytest.fixture(autouse=True, scope="module")
def _world_released_afterwards() -> Iterator[None]:
    """vLLM's one-process world (a gloo process group) lives while this module's tests run, not after."""
    yield
    from trl_vlm_fixes.selftest.vllm_model import release_world

    release_world()


def _vllm_model_or_skip(model_dir: Path, backend: str = "TRITON") -> Any:
    from trl_vlm_fixes.selftest.vllm_model import VllmModelUnavailable, build_vllm_model

    try:
        return build_vllm_model(model_dir, moe_backend=backend)
    except VllmModelUnavailable as error:
        pytest.skip(f"vLLM's model class cannot be built on this machine: {error}")


def _skip_where_vllm_transposes_the_experts(model_dir: Path) -> None:
    from transformers import AutoConfig

    from trl_vlm_fixes.moe_backend import fused_expert_layout_problem

    problem = fused_expert_layout_problem(AutoConfig.from_pretrained(model_dir))
    if problem:
        pytest.skip(f"{problem} (test_qwen3_vl_moe_push_fails_loudly shows it)")


class _Engine:
    """What TRL reaches of a colocated ``vllm.LLM`` while it pushes: ``llm_engine.model_executor.driver_worker.
    model_runner.model`` (vLLM's real model), and ``reset_prefix_cache`` after the push."""

    def __init__(self, model: Any) -> None:
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker))
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
    from trl_vlm_fixes.selftest.rollout_schedule import build_generation

    def build(**kwargs: Any) -> _Engine:
        engine.built_with = kwargs
        return engine

    return build_generation(None, processor, enable_sleep_mode=False, engine_class=build, model=trainer_model)


def _lora(model: Any, family: str) -> Any:
    """LoRA as a GRPO run puts it: attention (full and, Qwen3.5, Gated-DeltaNet), the vision tower's attention, the
    shared expert, and the routed experts' fused tensors (peft's ``target_parameters``)."""
    from peft import LoraConfig, get_peft_model

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "attn.qkv", "attn.proj"]
    if family == "qwen3_5_moe":
        modules += ["in_proj_qkv", "in_proj_z", "out_proj"]
        modules += ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"]
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=modules, target_parameters=targets))


def _optimizer_step(model: Any, seed: int = 0) -> None:
    """One SGD step on a random gradient, for every parameter the optimizer owns (all of them, or LoRA's)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator), alpha=-0.05)


def _trained_checkpoint(trainer_model: Any, model_dir: Path, out: Path) -> dict[str, Any]:
    """The trainer's weights as a checkpoint (LoRA merged by peft) beside the original tokenizer and processor; the
    merged state dict."""
    from peft import PeftModel

    shutil.copytree(model_dir, out)
    merged = copy.deepcopy(trainer_model)
    if isinstance(merged, PeftModel):
        merged = merged.merge_and_unload()
    merged.save_pretrained(out)
    return {name: tensor.detach().clone() for name, tensor in merged.state_dict().items()}


def _moe_layout(state: dict[str, Any], num_layers: int, shared_expert: bool) -> dict[str, Any]:
    """vLLM's mixture-of-experts parameters from the trainer's tensors by the documented layout (no vLLM code)."""
    layout = {}
    for layer in range(num_layers):
        hf, vllm = f"model.language_model.layers.{layer}.mlp.", f"language_model.model.layers.{layer}.mlp."
        layout[W13.format(layer)] = state[hf + "experts.gate_up_proj"]
        layout[vllm + "experts.routed_experts.w2_weight"] = state[hf + "experts.down_proj"]
        layout[vllm + "gate.weight"] = state[hf + "gate.weight"]
        if shared_expert:
            gate, up = state[hf + "shared_expert.gate_proj.weight"], state[hf + "shared_expert.up_proj.weight"]
            layout[vllm + "shared_expert.gate_up_proj.weight"] = torch.cat([gate, up])
            layout[vllm + "shared_expert.down_proj.weight"] = state[hf + "shared_expert.down_proj.weight"]
            layout[vllm + "shared_expert_gate.weight"] = state[hf + "shared_expert_gate.weight"]
    return layout


def _mismatches(pushed: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    names = sorted(set(pushed) | set(expected))
    return [n for n in names if n not in pushed or n not in expected or not torch.equal(pushed[n], expected[n])]


@dataclass
class Push:
    """One push and the models to compare it with."""

    engine: Any  # the vLLM model TRL pushed into (trl_vlm_fixes.selftest.vllm_model.VllmModel)
    reference: Any  # vLLM's loader on the trained checkpoint
    checkpoint: Any  # vLLM's loader on the original checkpoint
    layout: dict[str, Any]  # the documented layout of the MoE parameters
    names: list[str] = field(default_factory=list)

    def against_reference(self) -> list[str]:
        return _mismatches(self.engine.parameters(), self.reference.parameters())

    def against_layout(self) -> list[str]:
        pushed = self.engine.parameters()
        return _mismatches({n: pushed[n] for n in self.layout}, self.layout)

    def changed_by_training(self) -> set[str]:
        return set(_mismatches(self.reference.parameters(), self.checkpoint.parameters()))


@pytest.fixture
def moe_push(family_model_dir: Callable[[str], Path], tmp_path: Path) -> Callable[..., Push]:
    """Train one step, push through TRL's sync_weights into vLLM's model built on the original checkpoint."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_vlm_fixes.selftest.vllm_model import cpu_platform

    def run(
        family: str, peft: bool = False, tamper: tuple[str, Callable[[Any], Any]] | None = None, backend: str = "TRITON"
    ) -> Push:
        model_dir = family_model_dir(family)
        _skip_where_vllm_transposes_the_experts(model_dir)
        engine_model = _vllm_model_or_skip(model_dir, backend)  # the engine TRL built on the checkpoint
        trainer = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        layers = trainer.config.text_config.num_hidden_layers
        if peft:
            trainer = _lora(trainer, family)
        _optimizer_step(trainer)
        trained_dir = Path(tempfile.mkdtemp(dir=tmp_path)) / "trained"
        state = _trained_checkpoint(trainer, model_dir, trained_dir)

        with torch.no_grad():
            for parameter in engine_model.model.parameters():
                parameter.fill_(float("nan"))  # a parameter the push never reaches cannot pass
        engine = _Engine(engine_model.model if tamper is None else _Tampered(engine_model.model, *tamper))
        generation = _generation(trainer, engine, AutoProcessor.from_pretrained(model_dir))
        with cpu_platform():
            generation.sync_weights()  # TRL's own code, into vLLM's own load_weights
        assert engine.prefix_cache_resets == 1
        assert engine.built_with["model"] == str(model_dir)

        return Push(
            engine=engine_model,
            reference=_vllm_model_or_skip(trained_dir, backend),
            checkpoint=_vllm_model_or_skip(model_dir, backend),
            layout=_moe_layout(state, layers, shared_expert=family == "qwen3_5_moe"),
            names=sorted(engine_model.parameters()),
        )

    return run


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_vllm_parameter_is_the_trainers(moe_push: Callable[..., Push], family: str, peft: bool) -> None:
    push = moe_push(family, peft)
    assert push.against_reference() == []
    assert push.against_layout() == []
    assert set(push.engine.moe_backends.values()) == {"TRITON"}
    names = set(push.names)
    assert any(n.startswith("visual.") for n in names)
    assert {W13.format(0), W13.format(1)} <= set(push.layout) <= names
    # the step changed what it should: every parameter (full); LoRA's targets, the experts among them (LoRA)
    changed = push.changed_by_training()
    assert changed == names if not peft else {W13.format(0), W13.format(1)} < changed < names


@pytest.mark.parametrize(
    "change",
    [lambda t: t.transpose(-1, -2).contiguous(), lambda t: torch.cat(t.chunk(2, dim=1)[::-1], dim=1)],
    ids=["transposed", "gate-up-swapped"],
)
def test_a_wrong_expert_layout_is_caught(moe_push: Callable[..., Push], change: Callable[[Any], Any]) -> None:
    """The tiny experts' ``gate_up_proj`` is square per expert (2I == H): both changes keep its shape, as a silent
    layout error would, and vLLM takes them without a word."""
    push = moe_push("qwen3_5_moe", tamper=("model.language_model.layers.1.mlp.experts.gate_up_proj", change))
    assert push.against_reference() == [W13.format(1)]
    assert push.against_layout() == [W13.format(1)]


def test_flashinfer_cutlass_push_is_wrong_until_its_post_load_step_reruns(moe_push: Callable[..., Push]) -> None:
    """FlashInfer CUTLASS's post-load step (vLLM's own, plain torch) swaps the halves of ``w13``: an engine built
    on it and then pushed to holds ``[gate; up]`` where its kernel reads ``[up; gate]``, with no error. Re-running
    the backend's own step on the pushed experts makes every parameter what a fresh engine would hold."""
    from trl_vlm_fixes.moe_backend import rerun_expert_post_load
    from trl_vlm_fixes.selftest.vllm_model import cpu_platform

    push = moe_push("qwen3_5_moe", backend="FLASHINFER_CUTLASS")
    assert set(push.engine.moe_backends.values()) == {"FLASHINFER_CUTLASS"}
    assert push.against_reference() == [W13.format(0), W13.format(1)]  # silent: same shapes, swapped halves
    assert push.against_layout() == []  # the push itself landed in the loader's layout
    gate, up = push.layout[W13.format(0)].chunk(2, dim=1)
    assert torch.equal(push.reference.parameters()[W13.format(0)], torch.cat([up, gate], dim=1))

    with cpu_platform():
        processed = rerun_expert_post_load(push.engine.model)
    assert len(processed) == 2
    assert push.against_reference() == []


def test_qwen3_vl_moe_push_fails_loudly(tmp_path: Path) -> None:
    """Where vLLM reads fused Qwen3-VL-MoE experts in the released checkpoints' transposed layout (vLLM >= 0.26),
    TRL's push of transformers 5's tensors fails on the first expert tensor: loud, never a silent wrong layout. The
    engine is built on a checkpoint in the released layout, with experts whose tensors are not square (8 != 32)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_vlm_fixes.moe_backend import fused_expert_layout_problem
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm
    from trl_vlm_fixes.selftest.vllm_model import cpu_platform

    model_dir = build_tiny_qwen35_vlm(tmp_path / "vl", family="qwen3_vl_moe", text={"moe_intermediate_size": 8})
    weights_file = str(model_dir / "model.safetensors")
    weights = load_file(weights_file)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[name] = weights[name].transpose(1, 2).contiguous()  # as Qwen/Qwen3-VL-*-A*B store them
    save_file(weights, weights_file, metadata={"format": "pt"})
    trainer = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)  # transposes them back
    problem = fused_expert_layout_problem(trainer.config)
    engine_model = _vllm_model_or_skip(model_dir)
    engine = _Engine(engine_model.model)
    generation = _generation(trainer, engine, AutoProcessor.from_pretrained(model_dir))
    if problem is None:
        with cpu_platform():
            generation.sync_weights()
        expected = trainer.model.language_model.layers[0].mlp.experts.gate_up_proj.detach()
        assert torch.equal(engine_model.parameters()[W13.format(0)], expected)
        return
    with cpu_platform(), pytest.raises(RuntimeError, match="size of tensor"):
        generation.sync_weights()


@pytest.mark.parametrize("fix_on", [False, True], ids=["fix-off", "fix-on"])
def test_the_engine_trl_builds_runs_a_backend_its_pushes_land_in(
    moe_push: Callable[..., Push],
    family_model_dir: Callable[[str], Path],
    with_setting: Callable[[str, str], None],
    fix_on: bool,
) -> None:
    """expert_layout end to end, on a GPU whose vLLM default rearranges the experts (simulated SM120 with FlashInfer:
    CUTLASS): TRL's own ``_init_vllm`` builds the engine's arguments, vLLM's oracle picks the backend for them, and
    vLLM's model class built on that backend takes TRL's push. Fix off: FlashInfer CUTLASS, both ``w13`` silently
    wrong, and the engine's read-back warns; fix on: ``moe_backend="triton"``, Triton, every parameter exact."""
    from simulated_gpu import oracle_choice, simulate_gpu
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from trl_vlm_fixes.patches.expert_layout import read_back

    model_dir = family_model_dir("qwen3_5_moe")
    trainer = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    recorder = _Engine(None)
    with_setting("TRL_VLM_FIXES_EXPERT_LAYOUT", "1" if fix_on else "0")
    with pytest.MonkeyPatch.context() as patch:
        simulate_gpu(patch, (12, 0), True)
        _generation(trainer, recorder, AutoProcessor.from_pretrained(model_dir))
        backend = oracle_choice(recorder.built_with, AutoConfig.from_pretrained(model_dir).text_config.to_dict())
    assert recorder.built_with.get("moe_backend") == ("triton" if fix_on else None)
    assert backend == ("TRITON" if fix_on else "FLASHINFER_CUTLASS")

    push = moe_push("qwen3_5_moe", backend=backend)
    assert push.against_reference() == ([] if fix_on else [W13.format(0), W13.format(1)])
    setting, warnings = read_back(_Engine(push.engine.model)) or ("", [])
    assert setting == f"MoE backend={backend}"
    assert bool(warnings) is not fix_on
