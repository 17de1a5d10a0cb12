"""What a ``VLLMGeneration.generate`` waits on, and only that: the colocated engine, or the server.

Colocate: vLLM's ``LLM.generate`` loops ``llm_engine.step()`` (``vllm/entrypoints/offline_utils.py``, 0.25.1 to 0.31),
one prefill chunk or one token for every running request per step; a wedged kernel is a step that never returns. So
the engine is hung when no step returned for the floor, however long the rollout: the clock starts at TRL's
``LLM.generate`` call and restarts at every step. A first step gets no more (vLLM warms up while it is built, and a
restart's first rollout replays the batch that hung). TRL's tensor-parallel prompt gather before that call waits on
the other ranks, a checkpoint save of rank 0 included: torch's process-group timeout times it, not this clock.
Server mode: the main process's ``VLLMClient`` calls, by total time; the gather and broadcast around them are torch's.
The hooks are instance attributes, set for one generate: vLLM's and TRL's classes are never touched.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from . import limits, owners
from .report import ENGINE_STEP
from .timer import WATCHDOG

WHAT = "vLLM LLM.generate (colocate): the wait for the next engine step"
LIKELY_CAUSE = (
    "on Hopper with vLLM 0.25.1 and a Gated-DeltaNet model (Qwen3.5), FlashInfer 0.6.13's GDN prefill kernel "
    "(flashinfer-ai/flashinfer#3986, #2623: TRL_VLM_FIXES_GDN_PREFILL_BACKEND=triton, the default); CUDA-graph decode "
    "(the restart here builds the engine PIECEWISE, NONE after a second hang at this step); a device fault"
)
SERVER_CALLS = ("generate", "image_features")  # TRL >= 1.16 sends images to the server first
_MARK = "_trl_vlm_fixes_watched"
_ABSENT = object()
_ENGINE_LOOP = ("vllm.entrypoints.offline_utils", "vllm.entrypoints.llm")  # where vLLM's LLM.generate loops


@functools.cache
def generate_steps_the_engine() -> bool | None:
    """Does the installed vLLM's ``LLM.generate`` loop ``self.llm_engine.step()``, the progress the colocated watch
    counts? Read from its source: False would make a healthy long rollout look hung, so the total-time watch takes
    over; None without vLLM (a stand-in engine, whose step is its own)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for module in _ENGINE_LOOP:
        try:
            spec = importlib.util.find_spec(module)
            with open(spec.origin or "", encoding="utf-8") as handle:  # type: ignore[union-attr]
                if "self.llm_engine.step()" in handle.read():
                    return True
        except (ImportError, AttributeError, OSError, ValueError):
            continue
    return False


@contextmanager
def hooked(obj: Any, name: str, around: Callable[..., Any]) -> Iterator[None]:
    """While the block runs, ``obj.<name>(...)`` is ``around(original, ...)``; nothing where there is no such method,
    no instance dict, or a hook already (re-entry). Someone else's replacement made meanwhile is left in place."""
    original = getattr(obj, name, None)
    if not callable(original) or getattr(original, _MARK, False) or not hasattr(obj, "__dict__"):
        yield
        return
    own = vars(obj).get(name, _ABSENT)  # a stand-in or a test may have set its own

    def hook(*args: Any, **kwargs: Any) -> Any:
        return around(original, *args, **kwargs)

    setattr(hook, _MARK, True)
    setattr(obj, name, hook)
    try:
        yield
    finally:
        if vars(obj).get(name) is hook:
            if own is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, own)


@contextmanager
def watch_engine(llm: Any, floor: float, generation: Any) -> Iterator[None]:
    engine = getattr(llm, "llm_engine", None)
    if not callable(getattr(engine, "step", None)) or generate_steps_the_engine() is False:
        with hooked(llm, "generate", _total(limits.ENGINE_GENERATE, floor, generation)):
            yield
        return
    tokens: list[int] = []

    def generate(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        tokens.append(WATCHDOG.arm(floor, owners.describe(WHAT, generation, LIKELY_CAUSE, ENGINE_STEP)))
        try:
            return original(*args, **kwargs)
        finally:
            WATCHDOG.disarm(tokens.pop())

    def step(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        outputs = original(*args, **kwargs)
        if tokens:
            WATCHDOG.progress(tokens[-1])
        return outputs

    with hooked(engine, "step", step), hooked(llm, "generate", generate):
        yield


@contextmanager
def watch_server(client: Any, floor: float, generation: Any) -> Iterator[None]:
    with ExitStack() as stack:
        for name in SERVER_CALLS:
            stack.enter_context(hooked(client, name, _total(limits.SERVER_GENERATE, floor, generation)))
        yield


def _total(phase: limits.Phase, floor: float, generation: Any) -> Callable[..., Any]:
    def around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return limits.run_watched(phase, floor, generation, lambda: original(*args, **kwargs))

    return around
