"""What the watchdog costs: one arm plus one disarm per watched call (goal: < 50 us), and one re-arm per engine step
of a colocated rollout (goal: < 1% of a 10 ms decode step, that is < 100 us).

Arm and disarm set or clear the shared Python timer and the two kernel timers of the C-level backstop (two
``timer_settime`` calls each way, ``patches/watchdog/backstop.py``). A re-arm is what every ``LLMEngine.step`` that
returns costs while a colocated generate is watched (``engine.watch_engine``): the hook around ``step`` plus
``Watchdog.progress`` (the kernel timers move at most every ``BACKSTOP_REFRESH_SECONDS``), measured against an empty
step through the same hook-less loop.

    python benchmarks/watchdog_cost.py
Prints medians of 5 runs of 20,000 calls each, and the ratios to the goals, measured in one run.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

from trl_vlm_fixes.patches.watchdog import engine as watched_engine
from trl_vlm_fixes.patches.watchdog.timer import WATCHDOG, HangContext, Watchdog

DECODE_STEP_US = 10_000.0  # a fast decode step (10-30 ms on the GPU runs of docs/gpu-results.md): the worst case


def context() -> HangContext:
    raise AssertionError("the watchdog must not fire in this benchmark")


def pairs_per_second(dog: Watchdog, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        dog.disarm(dog.arm(1800.0, context))
    return count / (time.perf_counter() - started)


class Engine:
    def step(self) -> list[object]:
        return []


def steps_per_second(engine: Engine, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        engine.step()
    return count / (time.perf_counter() - started)


def rearm_us(count: int) -> float:
    """Per engine step: a watched step minus a bare one (the same engine, the same loop), as in a colocated generate."""
    engine = Engine()
    llm = SimpleNamespace(llm_engine=engine, generate=lambda: steps_per_second(engine, count))
    bare = 1e6 / llm.generate()
    with watched_engine.watch_engine(llm, 1800.0, None):  # as the watchdog's generate wrapper
        watched = 1e6 / llm.generate()
    return watched - bare


def empty_calls_per_second(count: int) -> float:
    def nothing() -> None:
        return None

    started = time.perf_counter()
    for _ in range(count):
        nothing()
    return count / (time.perf_counter() - started)


def main() -> None:
    dog = Watchdog()
    dog.disarm(dog.arm(1800.0, context))  # start the shared thread and make the kernel timers outside the timing
    count = 20_000
    arm_disarm_us = statistics.median(1e6 / pairs_per_second(dog, count) for _ in range(5))
    empty_us = statistics.median(1e6 / empty_calls_per_second(count) for _ in range(5))
    WATCHDOG.disarm(WATCHDOG.arm(1800.0, context))
    step_us = statistics.median(rearm_us(count) for _ in range(5))
    print(f"arm + disarm: {arm_disarm_us:.2f} us per watched call (goal < 50 us); an empty call: {empty_us:.3f} us")
    print(f"ratio to the goal: {arm_disarm_us / 50:.3f}")
    print(f"re-arm per engine step: {step_us:.2f} us, {100 * step_us / DECODE_STEP_US:.3f}% of a 10 ms decode step")
    print(f"ratio to the goal (1% of the step): {step_us / (DECODE_STEP_US / 100):.3f}")


if __name__ == "__main__":
    main()
