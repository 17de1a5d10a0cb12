"""The model the engine stand-in serves: the checkpoint's own transformers class, run with the engine's current weights.

A real vLLM engine computes next-token logits with its own kernels from the weights it holds (loaded from the
checkpoint, pushed by TRL, zeroed by a level-2 sleep); the stand-in computes them with the checkpoint's transformers
class (the trainer's own model code) from the weights it holds, one forward pass of the whole sequence per step,
unpadded, so that the engine and the trainer disagree only where the real ones would (different prompts, different
weights). Images are processed with the checkpoint's own image processor. A prompt whose image pads do not match its
images (vLLM expanding TRL's already expanded ids, which ``prompt_parity`` removes) cannot be given the image features
where vLLM places them; the stand-in then samples from its tokens alone, a corrupted prompt as the real engine's is.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


class ServedModel:
    """Next-token logits of one checkpoint, from whatever weights an engine holds (names as TRL pushes them)."""

    def __init__(self, model_dir: str) -> None:
        import transformers

        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.multimodal = "vision_config" in config
        loader = transformers.AutoModelForImageTextToText if self.multimodal else transformers.AutoModelForCausalLM
        self.module = loader.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.checkpoint = {name: p.detach().clone() for name, p in self.module.named_parameters()}
        text_config = self.module.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self.eos_token_ids = _ids(getattr(self.module.generation_config, "eos_token_id", None))
        self.image_token_id = getattr(self.module.config, "image_token_id", None)
        self.video_token_id = getattr(self.module.config, "video_token_id", None)
        vision = getattr(self.module.config, "vision_config", None)
        self.merge = int(getattr(vision, "spatial_merge_size", 2) or 2)
        self.image_processor = (
            transformers.AutoProcessor.from_pretrained(model_dir).image_processor if self.multimodal else None
        )
        self._loaded: Any = None

    def use(self, weights: dict[str, torch.Tensor], key: Any) -> None:
        """Compute with ``weights`` from now on (``key`` changes whenever they do). An engine missing one of the
        model's parameters, or holding a name the model does not have, is a stand-in error, never ignored."""
        if key == self._loaded:
            return
        parameters = dict(self.module.named_parameters())
        missing = sorted(set(parameters) - set(weights))
        if missing:
            raise RuntimeError(f"engine stand-in holds no value for {missing[:3]} (of {len(missing)})")
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(weights[name])
        self._loaded = key

    def vision_inputs(self, ids: list[int], images: list[Any]) -> dict[str, torch.Tensor]:
        """The model's image inputs for a prompt, or {} where its pads do not match the images (see module doc)."""
        if not images or self.image_processor is None:
            return {}
        processed = self.image_processor(images=images, return_tensors="pt")
        grid = processed["image_grid_thw"]
        needed = int((grid.prod(dim=-1) // (self.merge * self.merge)).sum())
        if self.image_token_id is None or ids.count(self.image_token_id) != needed:
            return {}
        return {"pixel_values": processed["pixel_values"], "image_grid_thw": grid}

    def next_logits(self, prompt: list[int], output: list[int], vision: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits [vocab] of the token after ``prompt + output`` (float32, before any sampling setting).

        An image pad the engine sampled is a token like any other to vLLM (its embedding row, no image features): it
        goes into the model as a neutral id whose embedding is replaced by the pad's, so that transformers does not
        take it for a placeholder of the prompt's images."""
        ids = prompt + output
        input_ids = torch.tensor([ids])
        inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        sampled_pads: list[int] = []
        if self.multimodal:
            markers = torch.zeros_like(input_ids)
            if self.image_token_id is not None and vision:
                markers[0, : len(prompt)][input_ids[0, : len(prompt)] == self.image_token_id] = 1
                sampled_pads = [len(prompt) + i for i, token in enumerate(output) if token == self.image_token_id]
                input_ids[0, sampled_pads] = 0
            inputs["mm_token_type_ids"] = markers
            inputs.update(vision)
        with torch.no_grad(), self._embedded_as(sampled_pads, self.image_token_id):
            logits = self.module(**inputs, use_cache=False).logits
        return logits[0, -1, : self.vocab_size].to(torch.float32)

    @contextlib.contextmanager
    def _embedded_as(self, positions: list[int], token_id: int | None) -> Iterator[None]:
        """While the block runs, the input embeddings at ``positions`` are those of ``token_id``."""
        if not positions or token_id is None:
            yield
            return
        embeddings = self.module.get_input_embeddings()

        def replace(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
            output = output.clone()
            output[0, positions] = module.weight[token_id].to(output.dtype)
            return output

        handle = embeddings.register_forward_hook(replace)
        try:
            yield
        finally:
            handle.remove()


def _ids(value: Any) -> frozenset[int]:
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)


@functools.cache
def served_model(model_dir: str) -> ServedModel:
    """One per checkpoint and process (loading it costs more than a tiny model's decode step)."""
    return ServedModel(model_dir)
