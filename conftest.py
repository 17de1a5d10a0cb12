"""Shared fixtures: a tiny random Qwen3.5 VLM built offline, real TRL trainers, and fix on/off switching."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
# One OpenMP thread per process, here and in every process a test starts (they inherit it): tests run in several
# workers on few cores, and torch's default (one thread per core in every process) left OpenMP threads spinning
# against each other: measured on 2 cores with 3 workers, 83 tests took 210 s with the default and 65 s with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import trl_vlm_fixes
from trl_vlm_fixes import log_once

pytest_plugins = ["simulated_gpu"]  # its fixture: tests/simulated_gpu.py

DISTRIBUTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.fixture(autouse=True)
def isolated_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's colocate setup writes RANK/WORLD_SIZE/MASTER_PORT into os.environ; tests run in parallel, so each test
    gets its own port and leaves those variables as it found them (subprocesses inherit a clean rendezvous)."""
    for variable in DISTRIBUTED_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", free_port())


@pytest.fixture(autouse=True)
def no_earlier_trainer() -> Iterator[None]:
    """A trainer built or a line logged by an earlier test in the same worker must not decide what a later test's
    status or log says (CI ran test_reload_skip after a trainer that stepped reload_skip aside: order-dependent
    failure; a once-per-process line said by an earlier test would be missing from a later one's log)."""
    yield
    trl_vlm_fixes.REGISTRY.forget_scopes()
    log_once.forget()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny-qwen35-vlm"))


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Tiny random checkpoints of the other Qwen VLM families (qwen3_vl, qwen2_5_vl), built once per session."""
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            built[family] = build_tiny_qwen35_vlm(tmp_path_factory.mktemp(f"tiny-{family}"), family=family)
        return built[family]

    return build


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

    def build(kind: str = "grpo", **overrides: Any) -> Any:
        from trl_vlm_fixes.selftest.fixtures import build_trainer

        return build_trainer(tiny_model_dir, processor, str(tmp_path / kind), kind, **overrides)

    return build


@pytest.fixture
def reapply(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Apply the fixes again after the test changed what they read when TRL's modules are patched (a switch, an
    installed version, through ``monkeypatch``); afterwards everything is put back and applied again."""

    def again() -> None:
        trl_vlm_fixes.revert()
        trl_vlm_fixes.apply()

    yield again
    monkeypatch.undo()
    again()


@pytest.fixture
def with_setting(monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None]) -> Callable[[str, str], None]:
    """Set a fix's setting through its environment variable and apply again (settings are read at ``apply()``);
    restored after the test."""

    def set_setting(variable: str, value: str) -> None:
        monkeypatch.setenv(variable, value)
        reapply()

    return set_setting


@pytest.fixture
def one_fix_off(monkeypatch: pytest.MonkeyPatch, reapply: Callable[[], None]) -> Callable[[str], None]:
    """Turn one fix off through its environment switch (the others stay on), restored after the test."""

    def turn_off(name: str) -> None:
        monkeypatch.setenv(f"TRL_VLM_FIXES_{name.upper()}", "0")
        reapply()

    return turn_off


@pytest.fixture
def make_generation(tiny_model_dir: Path, processor: Any) -> Callable[..., Any]:
    """TRL's real VLLMGeneration (colocate) on the behavioural engine stand-in."""
    from trl_vlm_fixes.selftest.rollout_schedule import build_generation

    def build(enable_sleep_mode: bool = True, engine_class: type | None = None) -> Any:
        return build_generation(tiny_model_dir, processor, enable_sleep_mode, engine_class)

    return build


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen3_text

    return build_tiny_qwen3_text(tmp_path_factory.mktemp("tiny-qwen3-text"))


@pytest.fixture
def make_text_generation(tiny_text_model_dir: Path) -> Callable[..., Any]:
    """TRL's real VLLMGeneration (colocate) serving a text model without Gated-DeltaNet layers."""
    from transformers import AutoTokenizer

    from trl_vlm_fixes.selftest.rollout_schedule import build_generation

    def build() -> Any:
        tokenizer = AutoTokenizer.from_pretrained(tiny_text_model_dir)
        return build_generation(tiny_text_model_dir, tokenizer, text_only=True)

    return build
