"""``reload_skip``'s self-test check: on which weights each rollout of GRPO's schedule runs."""

from __future__ import annotations

from ..runner import CheckResult, SelftestContext, off_then_on


def check(context: SelftestContext, family: str) -> CheckResult:
    """TRL's real VLLMGeneration on the engine stand-in, driven as GRPO drives it (a second rollout in a step, a
    three-turn tool loop, a lone generate, an evaluation): on which weights does each rollout run?"""
    from ..rollout_schedule import TrainerLoop, build_generation, run_schedule

    def measure() -> TrainerLoop:
        loop = TrainerLoop(build_generation(context.model_dir(family), context.processor(family)))
        run_schedule(loop)
        return loop

    def bug(loop: TrainerLoop) -> tuple[bool, str]:
        detail = (
            f"fix off: {loop.stale}/{loop.generates} rollouts on stale or garbage weights, "
            f"{loop.engine.disk_reloads} disk reloads"
        )
        return loop.stale > 0, detail

    def fix(loop: TrainerLoop) -> tuple[bool, str]:
        ok = loop.stale == 0 and loop.engine.disk_reloads == 0 and loop.max_full_pushes_per_generate <= 1
        return ok, (
            f"fix on: {loop.generates - loop.stale}/{loop.generates} rollouts on current weights, "
            f"{loop.engine.disk_reloads} disk reloads"
        )

    return off_then_on("reload_skip", measure, bug, fix)
