"""vLLM's real model class as TRL's colocated engine on the CPU, with what a level-2 sleep does to its memory.

For the wake_reset fix (``tests/test_every_tensor.py``, its self-test check). TRL's real ``VLLMGeneration`` builds this
engine in place of ``vllm.LLM`` (``rollout_schedule.build_generation``); its push reaches vLLM's own model class
(``vllm_model``: built on the CPU by vLLM's loader) through the path of a real colocated engine
(``llm_engine.model_executor.driver_worker.model_runner``), and ``generate`` runs vLLM's own forward of that class, one
prefill per prompt (attention is the one layer replaced: plain causal attention over the prompt, as vLLM's kernels
compute it for one sequence with no cache; the logits equal transformers' own model's to 4e-7 on the tiny
checkpoints), greedy, one token.

Its sleep is vLLM 0.25.1's (``Worker.sleep``/``wake_up`` around ``CuMemAllocator``): level 2 saves the named buffers to
the CPU and releases every allocation of the "weights" pool without a backup; waking maps new pages, whose contents
are the driver's (here ``WAKE_PAGES``: NaN, an unlucky driver; 0.0 a lucky one), then restores the buffers. What the
weights pool holds is every tensor the model allocated while vLLM built it: its parameters, its buffers, and every
tensor kept as a module's attribute (``pool_tensors``, read from the model, not from the fix). Level 1 keeps
everything (the pool is backed up to the CPU). ``reload_weights`` is vLLM's ``GPUModelRunner.reload_weights`` for an
unquantized model: the checkpoint through the loader's ``get_all_weights`` into ``model.load_weights``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .engine_standin import CompletionOutput, Logprob, RequestOutput, built_config
from .vllm_model import VllmModel, VllmModelUnavailable, build_vllm_model, cpu_platform, release_world

__all__ = ["VllmModelUnavailable"]

WAKE_PAGES = float("nan")  # what a wake after a level-2 sleep leaves in the weights pool (class attribute below)
# the families whose vLLM model class has deepstack buffers, for each family the self-test builds
DEEPSTACK_SIBLING = {"qwen3_5": "qwen3_vl", "qwen3_5_moe": "qwen3_vl_moe"}
_lock = threading.RLock()


def pool_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every non-empty tensor the model allocated at build, by name: parameters, buffers, and tensors (alone or in a
    list or tuple) kept as attributes of its modules: what vLLM's weights pool holds."""
    found: dict[str, torch.Tensor] = {}
    found.update(model.named_parameters())
    found.update(model.named_buffers())
    for prefix, module in model.named_modules():
        for attribute, value in vars(module).items():
            if attribute in ("_parameters", "_buffers", "_modules"):
                continue
            items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
            for index, tensor in items:
                if isinstance(tensor, torch.Tensor) and not isinstance(tensor, torch.nn.Parameter):
                    name = f"{prefix}.{attribute}" if prefix else attribute
                    found.setdefault(name if index is None else f"{name}[{index}]", tensor)
    return {name: tensor for name, tensor in found.items() if tensor.numel() > 0}


def plain_pool_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of the weights pool that are neither parameters nor buffers (nothing in vLLM restores them)."""
    kept = {id(tensor) for tensor in model.parameters()} | {id(tensor) for tensor in model.buffers()}
    return {name: tensor for name, tensor in pool_tensors(model).items() if id(tensor) not in kept}


class WeightsPool:
    """vLLM's level-2 sleep of one model: buffers saved, the pool's pages released; waking: new pages, buffers back."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.discarded = False
        self._saved_buffers: dict[str, torch.Tensor] = {}

    def sleep(self, level: int) -> None:
        if level >= 2 and not self.discarded:
            self._saved_buffers = {name: buffer.clone() for name, buffer in self.model.named_buffers()}
            self.discarded = True

    def wake(self, pages: float) -> None:
        if not self.discarded:
            return
        with torch.no_grad():
            for tensor in pool_tensors(self.model).values():
                tensor.fill_(pages)
            for name, buffer in self.model.named_buffers():
                if name in self._saved_buffers:
                    buffer.copy_(self._saved_buffers.pop(name))
        self.discarded = False


@dataclass
class _Built:
    engine: VllmModel  # the engine's model: put back to ``pristine`` for every engine built on it
    fresh: VllmModel  # never slept, never pushed: what a fresh engine computes
    pristine: dict[str, torch.Tensor]


_built: dict[str, _Built] = {}


def _models(model_dir: str) -> _Built:
    """The engine's and the fresh model for ``model_dir``, built once per process (vLLM's world of one rank stays up
    until ``release``); the engine's is put back to its state at build."""
    with _lock:
        if model_dir not in _built:
            engine, fresh = build_vllm_model(model_dir, moe_backend=None), build_vllm_model(model_dir, moe_backend=None)
            pristine = {name: tensor.clone() for name, tensor in pool_tensors(engine.model).items()}
            _built[model_dir] = _Built(engine, fresh, pristine)
        built = _built[model_dir]
        with torch.no_grad():
            for name, tensor in pool_tensors(built.engine.model).items():
                tensor.copy_(built.pristine[name])
        return built


def release() -> None:
    """Forget the built models and take vLLM's world of one rank down (a dense and a MoE model need different ones)."""
    with _lock:
        _built.clear()
        _rope_models.clear()
        release_world()


def _plain_causal_attention(
    self: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output_shape: Any = None,
    output_dtype: Any = None,
) -> torch.Tensor:
    """vLLM's ``Attention.forward`` for one sequence's prefill with no KV cache (vLLM's kernels need a GPU)."""
    tokens = query.shape[0]
    q = query.view(tokens, self.num_heads, self.head_size).transpose(0, 1)
    k = key.view(tokens, self.num_kv_heads, self.head_size).transpose(0, 1)
    v = value.view(tokens, self.num_kv_heads, self.head_size_v).transpose(0, 1)
    repeats = self.num_heads // self.num_kv_heads
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0), is_causal=True, scale=self.impl.scale
    )
    return out.transpose(0, 1).reshape(tokens, self.num_heads * self.head_size_v)


_rope_models: dict[str, Any] = {}


def _positions(model_dir: str, ids: torch.Tensor, vision: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """The M-RoPE positions (3, tokens): the checkpoint's own rope index (transformers) for an image prompt."""
    if vision is None:
        return torch.arange(len(ids)).expand(3, len(ids)).contiguous()
    if model_dir not in _rope_models:
        from transformers import AutoModelForImageTextToText

        _rope_models[model_dir] = AutoModelForImageTextToText.from_pretrained(model_dir).model
    rope_model = _rope_models[model_dir]
    positions, _ = rope_model.get_rope_index(
        ids[None], vision["mm_token_type_ids"], vision["image_grid_thw"], attention_mask=torch.ones_like(ids)[None]
    )
    return positions[:, 0]


def forward_logits(
    built: VllmModel, model_dir: str, ids: list[int], vision: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """vLLM's own forward of one prompt (its vision tower, ``embed_input_ids`` and deepstack, the text model,
    ``compute_logits``): the logits of every prompt position. ``vision``: the checkpoint processor's ``pixel_values``,
    ``image_grid_thw`` and ``mm_token_type_ids`` for an image prompt whose ids hold the image's pads."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention

    model = built.model
    tokens = torch.tensor(ids)
    positions = _positions(model_dir, tokens, vision)
    with _lock, cpu_platform(), set_current_vllm_config(built.vllm_config), torch.no_grad():
        saved, Attention.forward = Attention.forward, _plain_causal_attention  # type: ignore[method-assign]
        try:
            with set_forward_context(None, built.vllm_config):
                if vision is None:
                    embeds = model.embed_input_ids(tokens)
                else:
                    image = model.embed_multimodal(
                        pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"]
                    )
                    mask = tokens == model.config.image_token_id
                    embeds = model.embed_input_ids(tokens, image, is_multimodal=mask)
                hidden = model(input_ids=None, positions=positions, inputs_embeds=embeds)
                return model.compute_logits(hidden)
        finally:
            Attention.forward = saved  # type: ignore[method-assign]


class VllmModelLLM:
    """A colocated ``vllm.LLM`` as TRL drives it (sleep, wake_up, reload, push, generate) on vLLM's real model class.

    ``logits``: for every prompt generated, (the engine's logits, a fresh model's logits) of every position."""

    WAKE_PAGES = WAKE_PAGES

    def __init__(self, model: str, *, enable_sleep_mode: bool = False, **kwargs: Any) -> None:
        self.init_kwargs: dict[str, Any] = {"model": model, "enable_sleep_mode": enable_sleep_mode, **kwargs}
        self.model_dir = str(model)
        built = _models(self.model_dir)
        self.vllm, self.fresh = built.engine, built.fresh
        self.pool = WeightsPool(self.vllm.model)
        self.sleeps: list[int] = []
        self.wakes = 0
        self.disk_reloads = 0
        self.logits: list[tuple[torch.Tensor, torch.Tensor]] = []
        served = self.vllm.model
        runner = SimpleNamespace(model=served, get_model=lambda: served)
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
            model_config=SimpleNamespace(
                max_model_len=kwargs.get("max_model_len") or 256,
                logprobs_mode=kwargs.get("logprobs_mode", "raw_logprobs"),
            ),
            reset_encoder_cache=lambda: None,
            vllm_config=built_config(kwargs),  # what the engine fixes read back, as the stand-in models it
        )
        self.weights_awake = self.kv_cache_awake = True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.init_kwargs["enable_sleep_mode"]:
            raise RuntimeError("sleep() needs enable_sleep_mode=True")
        self.sleeps.append(level)
        self.pool.sleep(level)
        self.weights_awake = self.kv_cache_awake = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and not self.weights_awake:
            self.pool.wake(self.WAKE_PAGES)
            self.wakes += 1
        self.weights_awake = self.weights_awake or "weights" in tags
        self.kv_cache_awake = self.kv_cache_awake or "kv_cache" in tags

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if method != "reload_weights":
            raise NotImplementedError(f"this engine has no worker method {method!r}")
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model_loader

        config = self.vllm.vllm_config
        with _lock, cpu_platform(), set_current_vllm_config(config):
            loader: Any = get_model_loader(config.load_config)
            self.vllm.model.load_weights(loader.get_all_weights(config.model_config, self.vllm.model))
        self.disk_reloads += 1
        return [None]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return True

    def reset_mm_cache(self) -> None:
        return None

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: Any = True, **_: Any) -> list[Any]:
        if not (self.weights_awake and self.kv_cache_awake):
            raise RuntimeError("generate() on a sleeping engine")
        want_logprobs = getattr(sampling_params, "logprobs", None) is not None
        outputs = []
        for prompt in prompts if isinstance(prompts, list) else [prompts]:
            if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
                raise NotImplementedError("this engine generates from text prompts (forward_logits takes images)")
            ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else list(prompt)
            logits = forward_logits(self.vllm, self.model_dir, ids)
            self.logits.append((logits, forward_logits(self.fresh, self.model_dir, ids)))
            last = torch.log_softmax(logits[-1], dim=-1)
            token = int(torch.nan_to_num(last, nan=float("-inf")).argmax())
            logprobs = [{token: Logprob(float(last[token]))}] if want_logprobs else None
            outputs.append(RequestOutput(ids, [CompletionOutput([token], logprobs)]))
        return outputs


def processed_image_prompt(model_dir: str | Path, text: str, image: Any) -> tuple[list[int], dict[str, torch.Tensor]]:
    """An image prompt as the checkpoint's processor makes it: its ids (the image's pads in place) and vision inputs."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    encoded = processor(
        text=[processor.apply_chat_template(messages, add_generation_prompt=True)], images=[image], return_tensors="pt"
    )
    vision = {key: encoded[key] for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    return encoded["input_ids"][0].tolist(), vision


TEXT_PROMPT = "a text prompt: every step of it reads the deepstack rows a wake left behind"


@dataclass
class WakeCheck:
    """TRL's generate, twice (each after a level-2 sleep: the engine build's, then its own), on this engine."""

    model_dir: str | Path
    processor: Any
    label: str = "the model"  # what the verdicts name (the self-test runs the deepstack sibling of its family)

    def measure(self) -> VllmModelLLM:
        from .rollout_schedule import build_generation

        generation = build_generation(self.model_dir, self.processor, engine_class=VllmModelLLM)
        ids = self.processor.tokenizer.encode(TEXT_PROMPT)
        for _ in range(2):
            generation.generate(prompts=[ids], images=None, num_generations=1)
        engine: VllmModelLLM = generation.llm
        return engine

    @staticmethod
    def differing(engine: VllmModelLLM) -> int:
        """Prompts whose logits differ from a fresh model's (NaN anywhere differs)."""
        return sum(not torch.equal(served, fresh) for served, fresh in engine.logits)

    def judge_bug(self, engine: VllmModelLLM) -> tuple[bool, str]:
        bad = self.differing(engine)
        return bad > 0, f"{self.label}, fix off: {bad}/{len(engine.logits)} generates off a fresh model's logits"

    def judge_fix(self, engine: VllmModelLLM) -> tuple[bool, str]:
        bad = self.differing(engine)
        good = len(engine.logits) - bad
        return bad == 0, f"fix on: {good}/{len(engine.logits)} generates on a fresh model's logits after NaN wakes"
