"""What the rollout watchdog costs per vLLM generate: one arm plus one disarm (goal: < 50 us).

Each sets or clears the shared Python timer and the two kernel timers of the C-level backstop (two ``timer_settime``
calls each way, ``patches/watchdog/backstop.py``).

    python benchmarks/watchdog_cost.py
Prints the median of 5 runs of 20,000 arm/disarm pairs, and the ratio to an empty call, measured in one run.
"""

from __future__ import annotations

import statistics
import time

from trl_vlm_fixes.patches.watchdog.timer import HangContext, Watchdog


def context() -> HangContext:
    raise AssertionError("the watchdog must not fire in this benchmark")


def pairs_per_second(dog: Watchdog, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        dog.disarm(dog.arm(1800.0, context))
    return count / (time.perf_counter() - started)


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
    print(f"arm + disarm: {arm_disarm_us:.2f} us per generate (goal < 50 us); an empty Python call: {empty_us:.3f} us")
    print(f"ratio to the goal: {arm_disarm_us / 50:.3f}")


if __name__ == "__main__":
    main()
