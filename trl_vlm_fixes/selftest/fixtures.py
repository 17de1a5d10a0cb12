"""Fixtures shared by the self-test, the tests, the example and the benchmarks: the mixed image batch, tiny trainers.

Prompts differ in text length and images differ in size, so the prompt token lengths differ: the case where TRL
1.9.1's left-padded ``prompt_ids`` and right-padded ``mm_token_type_ids`` stop describing the same columns.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# (image width, image height, prompt text): a big image with a short text beside a small image with a long text
# gives a length gap smaller than the big image's run, so the misaligned markers cut an image run (the crash).
MIXED_SAMPLES: tuple[tuple[int, int, str], ...] = (
    (128, 96, "describe"),
    (64, 32, "what is in this picture, tell me"),
    (96, 64, "colour?"),
    (32, 32, "count the shapes in the image, then name them"),
)


def make_image(width: int, height: int, seed: int = 0) -> Any:
    from PIL import Image

    return Image.new("RGB", (width, height), color=((37 * seed) % 256, (91 * seed + 50) % 256, 180))


def conversation(text: str, images: int = 1) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(images)]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def mixed_rows(samples: tuple[tuple[int, int, str], ...] = MIXED_SAMPLES) -> list[dict[str, Any]]:
    """Rows in TRL's conversational format with one image each."""
    return [
        {"prompt": conversation(text), "image": make_image(width, height, seed)}
        for seed, (width, height, text) in enumerate(samples)
    ]


def mixed_dataset(samples: tuple[tuple[int, int, str], ...] = MIXED_SAMPLES[:2]) -> Any:
    """A datasets.Dataset of the mixed rows; two prompts by default, so every batch of 4 (2 generations) holds both."""
    from datasets import Dataset

    rows = mixed_rows(samples)
    return Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "image": [r["image"] for r in rows]})


def text_dataset(words: tuple[str, ...] = ("a", "b", "c", "d")) -> Any:
    """Text-only prompts of equal length (a batch no fix but the one under test needs to score)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": word}] for word in words]})


def length_reward(completions: list[Any], **_: Any) -> list[float | None]:
    """A toy reward: longer completions score higher (enough for GRPO to have an advantage signal)."""
    return [float(len(str(completion))) for completion in completions]


def build_trainer(model_dir: Any, processor: Any, output_dir: str, kind: str = "grpo", **overrides: Any) -> Any:
    """A real GRPOTrainer or RLOOTrainer on the tiny model: CPU, float32, no reporting, mixed dataset by default
    (``dataset``, ``reward_funcs``, ``rollout_func`` and ``peft_config`` go to the trainer, the rest to its config)."""
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    classes: tuple[Any, Any] = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
    config_class, trainer_class = classes
    dataset = overrides.pop("dataset", None)
    reward_funcs = overrides.pop("reward_funcs", length_reward)
    rollout = {"rollout_func": overrides.pop("rollout_func")} if "rollout_func" in overrides else {}
    if "peft_config" in overrides:
        rollout["peft_config"] = overrides.pop("peft_config")
    settings: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 8,
        "max_steps": 2,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "bf16": False,
        "save_strategy": "no",
        "seed": 0,
        **overrides,
    }
    return trainer_class(
        model=str(model_dir),
        reward_funcs=reward_funcs,
        args=config_class(**settings),
        train_dataset=dataset if dataset is not None else mixed_dataset(),
        processing_class=processor,
        **rollout,
    )


@contextmanager
def fix_switched(fix_name: str, on: bool) -> Iterator[None]:
    """The plugin re-applied with one fix's switch set (every other fix as the environment says), and put back as it
    was afterwards: a benchmark times a fix off and on in one process."""
    import trl_vlm_fixes

    from ..switches import fix_switch

    variable = fix_switch(fix_name)
    saved = os.environ.get(variable)
    os.environ[variable] = "1" if on else "0"
    trl_vlm_fixes.revert()
    trl_vlm_fixes.apply()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved
        trl_vlm_fixes.revert()
        trl_vlm_fixes.apply()
