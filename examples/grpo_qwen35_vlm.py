"""GRPO on a Qwen3.5 vision-language model with trl_vlm_fixes: copy this script and point it at your checkpoint.

Default: a tiny random Qwen3.5 VLM is built offline on the fly, so it runs on any CPU in under a minute.
    python examples/grpo_qwen35_vlm.py
    accelerate launch --multi_gpu --num_processes 2 examples/grpo_qwen35_vlm.py   # 2 ranks: on CPUs (gloo) or GPUs
    python examples/grpo_qwen35_vlm.py --model Qwen/Qwen3.5-0.8B --use-vllm --steps 100   # on a GPU
"""

import argparse
import logging
import os
import sys
import tempfile

import trl_vlm_fixes  # first line of your script: the fixes attach whenever TRL is imported
from trl_vlm_fixes.status import render_table


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint path or hub id (default: a tiny random Qwen3.5 VLM built offline)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2)")
    parser.add_argument("--use-vllm", action="store_true", help="vLLM colocate with sleep mode (needs a GPU)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (peft)")
    parser.add_argument("--output-dir", default=None, help="where checkpoints would go (default: a temp folder)")
    return parser.parse_args()


# TRL 1.9.1's GRPO loss (grpo_trainer.py `_compute_loss`, loss_type "dapo"): -sum(ratio * advantage) over the
# completion tokens / their count. With num_iterations=1 the policy that scores a batch is the one that sampled it
# (old log-probs = log-probs.detach()), so ratio = 1; advantages are rewards minus their group's mean, so they sum to
# zero in each group. The loss is then 0 wherever a group's completions have equal lengths; its gradient is not.
LOSS_MEANING = (
    "about the loss: GRPO's loss is -(ratio x advantage) averaged over completion tokens; here the policy that scores "
    "each batch is the one that sampled it (ratio 1) and advantages sum to zero in each group, so the loss is ~0 by "
    "construction (exactly 0 where a group's completions have equal lengths) while its gradient is not: watch the "
    "reward, not the loss."
)


def explain_fixes(model: str, mode: str, sleep_mode: bool) -> str:
    """Which fixes acted in this run, and why each other one stepped aside here: the run's own status, and the
    fixes' declarations for this checkpoint and mode (``trl-vlm-fixes status --model PATH --mode MODE``)."""
    plan = trl_vlm_fixes.applicability(model, mode, sleep_mode)["fixes"]
    acted, aside = [], []
    for name, state in trl_vlm_fixes.status()["patches"].items():
        if state["state"] == "stepped-aside":
            aside.append(f"  {name}: {state['detail'].partition(': ')[2]}")
        elif state["state"] != "applied":
            aside.append(f"  {name}: {state['state']}: {state['detail']}")
        elif plan[name]["verdict"] == "steps aside":
            aside.append(f"  {name}: {plan[name]['reason']}")
        else:
            acted.append(name)
    where = "without vLLM" if mode == "none" else f"with vLLM ({mode})"
    lines = [f"fixes that acted in this run ({where}): {', '.join(acted) or 'none'}", "stepped aside here:", *aside]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch
    from accelerate import PartialState
    from transformers import AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, length_reward, mixed_dataset
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    state = PartialState(cpu=not torch.cuda.is_available())
    # One folder for all ranks: the main process builds the tiny model, the others wait and read it.
    shared = [tempfile.mkdtemp(prefix="trl_vlm_fixes_example_") if state.is_main_process else None]
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(shared, from_process=0)
    workdir = str(shared[0])
    model = args.model
    if model is None:
        model = os.path.join(workdir, "tiny-qwen35-vlm")
        if state.is_main_process:
            build_tiny_qwen35_vlm(model)
        state.wait_for_everyone()
    trl_vlm_fixes.REGISTRY.import_targets()
    logging.getLogger("trl_vlm_fixes").info(
        "rank %d of %d, fix status:\n%s", state.process_index, state.num_processes, render_table(trl_vlm_fixes.status())
    )

    processor = AutoProcessor.from_pretrained(model)  # its default padding side, as users load it
    on_cpu = state.device.type != "cuda"
    config = GRPOConfig(
        output_dir=args.output_dir or os.path.join(workdir, "out"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8 if args.model is None else 128,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=on_cpu,
        bf16=not on_cpu,
        use_vllm=args.use_vllm,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=args.use_vllm,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=config,
        train_dataset=mixed_dataset(MIXED_SAMPLES),  # images of 4 sizes, prompts of 4 lengths
        processing_class=processor,
        peft_config=peft_config,
    )
    trainer.train()
    if trainer.state.global_step != args.steps:
        print(f"training stopped at step {trainer.state.global_step} of {args.steps}", file=sys.stderr)
        return 1
    logging.getLogger("trl_vlm_fixes").info(
        "rank %d finished %d steps with fixes %s",
        state.process_index,
        trainer.state.global_step,
        trl_vlm_fixes.REGISTRY.summary(),
    )
    if state.is_main_process:
        last = [log for log in trainer.state.log_history if "loss" in log][-1]
        fixes = {k: v for k, v in last.items() if k.startswith("trl_vlm_fixes/")}
        print(
            f"trained {trainer.state.global_step} steps on a mixed image batch; last loss {last['loss']:.4f}; "
            f"fix metrics {fixes}"
        )
        print(explain_fixes(model, "colocate" if args.use_vllm else "none", args.use_vllm))
        print(LOSS_MEANING)
    # leave the process group cleanly: exiting with it alive can abort a rank at teardown after a good run
    state.wait_for_everyone()
    state.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
