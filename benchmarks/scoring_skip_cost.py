"""scoring_skip's gain: the trainer's time per GRPO step with TRL 1.9.1's no-gradient scoring pass (fix off) and
without it (fix on), measured in one run.

    python benchmarks/scoring_skip_cost.py [--layers 4] [--hidden 64] [--completion 32] [--steps 4] [--repeat 3]
TRL's real GRPOTrainer in colocate mode on the CPU (float32, one thread), its engine the self-test's stand-in
(``selftest/engine_standin``: the checkpoint's transformers model decoding token by token through vLLM's own
Sampler), on a random Qwen3.5 VLM of the given size (3:1 Gated-DeltaNet/full attention) and the mixed image batch
(four prompts, four image sizes). Aligned steps, as the fix needs them: 2 rows per micro-batch, 2 micro-batches per
generation batch and per optimizer step (2 prompts x 2 generations), ``ignore_eos`` so every completion is
``--completion`` tokens long. Only the scoring-skip switch changes between the two runs; every other fix stays on.

Timed per optimizer step, the first step left out (warm-up), the median of the others, in CPU seconds of this
process (one thread: other work on the machine stretches it less than the wall clock, also printed): the step; TRL's
rollout (``_generate_and_score_completions``), within it the scoring pass (``_get_per_token_logps_and_entropies``
called with gradients disabled) and the engine's decoding (the stand-in's token-by-token loop, without a KV cache,
is far slower on the CPU than vLLM on a GPU, so the step without it is given too: the trainer's own share); the rest
of the step (the loss passes, where the fix computes the ratio, their backward and the optimizer); and TRL's logged
``step_time`` (wall clock of its ``training_step``s: the rollout, which transformers' ``training_step`` runs through
``_prepare_inputs``, and the loss passes). The logged importance-sampling ratios and losses of both runs are
compared. ``--repeat`` alternates the runs and reports each variant's fastest (CPU time). On a busy machine the two
runs' timings differ by its noise; the last line divides the run off's step by the same step less its own scoring
pass, a figure no noise between two runs reaches (what the fix adds to the loss passes is not in it: compare the
loss+optimizer column).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PHASES = ("rollout", "scoring", "decoding")  # CPU seconds inside TRL's rollout, its scoring pass, the engine's decoding


@dataclass
class Timed:
    """One training run: at each step's end, the process's CPU seconds, the wall clock and the CPU seconds spent so
    far in each phase; its no-gradient passes and TRL's log."""

    spent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    marks: dict[str, list[float]] = field(default_factory=lambda: {name: [] for name in ("cpu", "wall", *PHASES)})
    no_grad_passes: int = 0
    parameters: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)

    def step_ended(self) -> None:
        self.marks["cpu"].append(time.process_time())
        self.marks["wall"].append(time.perf_counter())
        for name, seconds in self.spent.items():
            self.marks[name].append(seconds)

    def clocked(self, phase: str, function: Callable[..., Any], without_grad: bool = False) -> Callable[..., Any]:
        """``function``, its CPU seconds added to ``phase`` (only its calls with gradients disabled, if asked)."""
        import torch

        def timed(*args: Any, **kwargs: Any) -> Any:
            if without_grad and torch.is_grad_enabled():
                return function(*args, **kwargs)
            started = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent[phase] += time.process_time() - started

        return timed

    def steps(self, name: str) -> list[float]:
        """Seconds of each step after the first (warm-up; before it: the run's start)."""
        return [after - before for before, after in itertools.pairwise(self.marks[name])]

    def per_step(self, name: str, less: str | None = None) -> float:
        """The median step after the first (less another phase, step by step): a burst of the machine's other work
        stretches one step, not the figure."""
        steps = self.steps(name)
        if less is not None:
            steps = [a - b for a, b in zip(steps, self.steps(less), strict=True)]
        return statistics.median(steps)

    def logged(self, key: str) -> list[float]:
        return [entry[key] for entry in self.log if key in entry]

    def step_time(self) -> float:
        """TRL's logged ``step_time`` (wall clock of its ``training_step``s of one optimizer step), the median after
        the first step."""
        return statistics.median(self.logged("step_time")[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (every fourth full attention)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the decoder")
    parser.add_argument("--completion", type=int, default=32, help="max_completion_length (every completion's)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is warm-up)")
    parser.add_argument("--repeat", type=int, default=3, help="runs each way, alternating; the fastest is reported")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is warm-up")

    # one thread, set where accelerate reads it too: with OMP_NUM_THREADS unset, its state of one CPU rank sets torch's
    # threads to the machine's cores when each trainer is built (a second run on 2 threads, spinning on a busy machine)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    from transformers import AutoProcessor, PrinterCallback, TrainerCallback

    from trl_vlm_fixes.patches.scoring_skip import scope
    from trl_vlm_fixes.selftest.checks.scoring_skip import RATIO, by_row, gap
    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, build_trainer, fix_switched, mixed_dataset
    from trl_vlm_fixes.selftest.rollout_schedule import standin_engine_installed
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm, sized_text

    torch.set_num_threads(1)
    text = sized_text(args.layers, args.hidden)

    def train(model_dir: Any, processor: Any, output_dir: str, on: bool) -> Timed:
        timed = Timed()

        class TimedLLM(StandInLLM):
            def generate(self, *a: Any, **k: Any) -> Any:
                return timed.clocked("decoding", super().generate)(*a, **k)

        class StepEnds(TrainerCallback):
            def on_train_begin(self, *_: Any, **__: Any) -> None:
                timed.step_ended()  # the warm-up step's start

            def on_step_end(self, *_: Any, **__: Any) -> None:
                timed.step_ended()

        with fix_switched("scoring_skip", on), standin_engine_installed(TimedLLM):
            trainer = build_trainer(
                model_dir,
                processor,
                output_dir,
                use_vllm=True,
                vllm_mode="colocate",
                per_device_train_batch_size=2,
                gradient_accumulation_steps=2,
                steps_per_generation=2,
                max_completion_length=args.completion,
                max_steps=args.steps,
                generation_kwargs={"seed": 0, "ignore_eos": True},
                reward_funcs=by_row,
                dataset=mixed_dataset(MIXED_SAMPLES),
                disable_tqdm=True,
            )
            if on and (reason := scope(trainer)):
                sys.exit(f"scoring_skip steps aside for this trainer: {reason}")
            trainer.remove_callback(PrinterCallback)
            trainer.add_callback(StepEnds())
            # bound methods: through the fixes' wrappers, as TRL calls them
            trainer._generate_and_score_completions = timed.clocked("rollout", trainer._generate_and_score_completions)
            trainer._get_per_token_logps_and_entropies = timed.clocked(
                "scoring", trainer._get_per_token_logps_and_entropies, without_grad=True
            )

            def count(*_: Any) -> None:
                if not torch.is_grad_enabled():
                    timed.no_grad_passes += 1

            trainer.model.register_forward_hook(count)
            if torch.get_num_threads() != 1:
                sys.exit(f"torch runs {torch.get_num_threads()} threads, not 1: the figures would not compare")
            timed.parameters = sum(p.numel() for p in trainer.model.parameters())
            trainer.train()
        timed.log = list(trainer.state.log_history)
        return timed

    runs: dict[str, list[Timed]] = {"fix off (TRL's pass)": [], "fix on (skipped)": []}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_tiny_qwen35_vlm(
            os.path.join(scratch, "model"), text=text, vision={"out_hidden_size": args.hidden}
        )
        processor = AutoProcessor.from_pretrained(model_dir)
        for _ in range(args.repeat):
            for label, fix_on in zip(runs, (False, True), strict=True):
                runs[label].append(train(model_dir, processor, os.path.join(scratch, "out"), fix_on))
    best = {label: min(timed, key=lambda t: t.per_step("cpu")) for label, timed in runs.items()}
    off, on = best.values()
    print(
        f"qwen3_5, {args.layers} layers, hidden {args.hidden} ({on.parameters / 1e6:.1f}M parameters), "
        f"completions of {args.completion} tokens, 4 rows per step (2 micro-batches of 2), {args.steps} steps (first "
        f"left out), float32 CPU, 1 thread; max difference of the logged mean importance-sampling ratio "
        f"{gap(off.logged(RATIO), on.logged(RATIO)):.1e}, of the loss {gap(off.logged('loss'), on.logged('loss')):.1e}"
    )
    print("seconds per step, median of the steps after the first (CPU time of this process, unless wall):")
    columns: dict[str, Callable[[Timed], float]] = {
        "step": lambda t: t.per_step("cpu"),
        "rollout": lambda t: t.per_step("rollout"),
        "  scoring pass": lambda t: t.per_step("scoring"),
        "  engine decode": lambda t: t.per_step("decoding"),
        "loss+optimizer": lambda t: t.per_step("cpu", less="rollout"),
        "step - decode": lambda t: t.per_step("cpu", less="decoding"),
        "step wall": lambda t: t.per_step("wall"),
        "TRL step_time": Timed.step_time,
    }
    print(f"{'':22}{'no-grad passes':>15}" + "".join(f"{name:>15}" for name in columns))
    for label, timed in best.items():
        cells = "".join(f"{column(timed):>15.3f}" for column in columns.values())
        print(f"{label:22}{timed.no_grad_passes:>15}{cells}")
    warm_up = {label: timed.steps("cpu")[0] for label, timed in best.items()}
    print(f"warm-up step (CPU s, not in the figures): {', '.join(f'{k} {v:.1f}' for k, v in warm_up.items())}")
    ratios = {name: column(off) / column(on) for name, column in columns.items() if column(on) > 0}
    print(
        f"ratio off / on: step {ratios['step']:.2f}x, step without the engine's decoding "
        f"{ratios['step - decode']:.2f}x, rollout {ratios['rollout']:.2f}x, "
        f"loss+optimizer {ratios['loss+optimizer']:.2f}x (wall: "
        f"{ratios['step wall']:.2f}x, TRL step_time {ratios['TRL step_time']:.2f}x)"
    )
    scoring, step, trainer_share = off.per_step("scoring"), off.per_step("cpu"), off.per_step("cpu", less="decoding")
    print(  # within the run off alone: no noise between two runs in it
        f"from the run off alone, step / (step - its scoring pass): {step / (step - scoring):.2f}x, without the "
        f"engine's decoding {trainer_share / (trainer_share - scoring):.2f}x (the pass: {scoring / step:.0%} of the "
        f"step, {scoring / trainer_share:.0%} of it without the decoding)"
    )


if __name__ == "__main__":
    main()
