"""Progress of a colocated vLLM engine: every engine step that returns restarts the rollout watchdog's clock.

vLLM 0.25.1's ``LLM.generate`` → ``_run_completion`` → ``_run_engine`` (``vllm/entrypoints/offline_utils.py``) loops
``while self.llm_engine.has_unfinished_requests(): step_outputs = self.llm_engine.step()``. One ``LLMEngine.step``
(``vllm/v1/engine/llm_engine.py``) is one scheduler iteration: a chunk of prefill, or one more token for every running
request, and the requests that finished in it. A step that returns is progress; a wedged kernel is a step that never
returns. So a rollout is hung when no step returned for the limit, however long the whole generate takes.

The hook is an attribute of the engine instance, set for one watched generate and removed after it: nothing outside a
watched generate pays for it, and vLLM's class is never touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_MARK = "_trl_vlm_fixes_progress"
_ABSENT = object()


def steppable(engine: Any) -> bool:
    """An engine whose steps can be watched: a ``step`` method, an instance dict, not already watched (re-entry)."""
    step = getattr(engine, "step", None)
    return callable(step) and hasattr(engine, "__dict__") and not getattr(step, _MARK, False)


@contextmanager
def steps_report(engine: Any, on_step: Callable[[], None]) -> Iterator[None]:
    """While the block runs, ``on_step()`` follows every ``engine.step()`` that returns (check ``steppable`` first)."""
    step = engine.step
    own = vars(engine).get("step", _ABSENT)  # a stand-in or a test may have set its own

    def watched_step(*args: Any, **kwargs: Any) -> Any:
        outputs = step(*args, **kwargs)
        on_step()
        return outputs

    setattr(watched_step, _MARK, True)
    engine.step = watched_step
    try:
        yield
    finally:
        if vars(engine).get("step") is watched_step:  # someone replaced it meanwhile: theirs stays
            if own is _ABSENT:
                del engine.step
            else:
                engine.step = own
