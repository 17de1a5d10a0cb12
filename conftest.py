"""Shared fixtures: a tiny random Qwen3.5 VLM built offline, real TRL trainers, and fix on/off switching."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

import trl_vlm_fixes


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trl_vlm_fixes.tiny_model import build_tiny_qwen35_vlm

    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny-qwen35-vlm"))


@pytest.fixture
def processor(tiny_model_dir: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_dir)


@pytest.fixture
def fixes_off() -> Iterator[None]:
    """Upstream behaviour for the duration of a test (revert), fixes back afterwards (apply)."""
    trl_vlm_fixes.revert()
    try:
        yield
    finally:
        trl_vlm_fixes.apply()


@pytest.fixture
def make_trainer(tiny_model_dir: Path, processor: Any, tmp_path: Path) -> Callable[..., Any]:
    """Build a real GRPOTrainer or RLOOTrainer on the tiny model (CPU, float32, no reporting)."""

    def build(kind: str = "grpo", dataset: Any = None, **overrides: Any) -> Any:
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

        from trl_vlm_fixes.demo import length_reward, mixed_dataset
        from trl_vlm_fixes.tiny_model import special_token_ids

        config_class, trainer_class = (GRPOConfig, GRPOTrainer) if kind == "grpo" else (RLOOConfig, RLOOTrainer)
        settings: dict[str, Any] = {
            "output_dir": str(tmp_path / kind),
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
            "generation_kwargs": {"suppress_tokens": special_token_ids(processor.tokenizer)},
        }
        settings.update(overrides)
        trainer_type = overrides.pop("trainer_class", None) or trainer_class
        settings.pop("trainer_class", None)
        return trainer_type(
            model=str(tiny_model_dir),
            reward_funcs=length_reward,
            args=config_class(**settings),
            train_dataset=dataset if dataset is not None else mixed_dataset(),
            processing_class=processor,
        )

    return build


@pytest.fixture
def one_fix_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Turn one fix off through its environment switch (the others stay on), restored after the test."""

    def turn_off(name: str) -> None:
        monkeypatch.setenv(f"TRL_VLM_FIXES_{name.upper()}", "0")
        trl_vlm_fixes.revert()
        trl_vlm_fixes.apply()

    yield turn_off  # type: ignore[misc]
    monkeypatch.undo()
    trl_vlm_fixes.revert()
    trl_vlm_fixes.apply()


@pytest.fixture
def make_generation(tiny_model_dir: Path, processor: Any) -> Callable[..., Any]:
    """TRL's real VLLMGeneration (colocate) on the behavioural engine stand-in."""
    from trl_vlm_fixes.rollout_schedule import build_generation

    def build(enable_sleep_mode: bool = True, engine_class: type | None = None) -> Any:
        return build_generation(tiny_model_dir, processor, enable_sleep_mode, engine_class)

    return build
