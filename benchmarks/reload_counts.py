"""Counted figures for reload_skip: disk reloads, tensor pushes and full pushes per generate, fix on and off.

TRL's real VLLMGeneration (colocate + sleep mode) on the behavioural engine stand-in, driven by TRL's own calling
pattern (sync when global_step changed) over a schedule with two rollouts per step, a tool-loop turn and evaluation.
    python benchmarks/reload_counts.py
"""

from __future__ import annotations

import tempfile


def main() -> None:
    from transformers import AutoProcessor

    import trl_vlm_fixes
    from trl_vlm_fixes.selftest.rollout_schedule import TrainerLoop, build_generation, run_schedule
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    scratch = tempfile.TemporaryDirectory()  # removed when main returns
    model_dir = build_tiny_qwen35_vlm(scratch.name)
    processor = AutoProcessor.from_pretrained(model_dir)
    rows = []
    for label, on in (("fix off (TRL 1.9.1)", False), ("fix on", True)):
        trl_vlm_fixes.revert()
        if on:
            trl_vlm_fixes.apply()
        loop = TrainerLoop(build_generation(model_dir, processor))
        run_schedule(loop)
        parameters = sum(1 for _ in loop.model.parameters())
        rows.append(
            (
                label,
                loop.generates,
                loop.engine.disk_reloads,
                loop.engine.tensor_pushes,
                loop.engine.tensor_pushes / parameters / loop.generates,
                loop.max_full_pushes_per_generate,
                loop.generates - loop.stale,
            )
        )
    trl_vlm_fixes.apply()
    print(
        f"{'':22}{'generates':>10}{'disk reloads':>14}{'tensor pushes':>15}{'full pushes/gen':>17}"
        f"{'max per gen':>13}{'on current weights':>20}"
    )
    for label, gens, reloads, pushes, per_gen, worst, current in rows:
        print(f"{label:22}{gens:>10}{reloads:>14}{pushes:>15}{per_gen:>17.2f}{worst:>13.0f}{current:>17}/{gens}")


if __name__ == "__main__":
    main()
