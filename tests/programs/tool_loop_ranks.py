"""A real GRPOTrainer(tools=[...]) under torchrun (gloo, CPU) where the ranks take different numbers of tool turns.

By default rank 0's completions call the tool twice per rollout (3 generates), rank 1's never (1 generate). The
colocated engine is the behavioural stand-in (colocate + sleep mode). Each rank writes rank{N}.json: how many rollouts
ran on the trainer's current weights, every collective operation it entered in order (with the plugin's frames on the
stack, innermost first), and what its trainer logged. A parameter gather of ``sync_weights`` is listed as a collective
too: it is one under ZeRO-3 (no-op here), so a push on one rank only shows as a difference between the ranks.

usage: tool_loop_ranks.py MODEL_DIR OUTPUT_DIR [TURNS_RANK0,TURNS_RANK1]   (default 2,0; switches from the environment)
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from program_end import end_program

import trl_vlm_fixes

PLUGIN_DIR = os.path.dirname(trl_vlm_fixes.__file__)
HARNESS_DIR = os.path.join(PLUGIN_DIR, "selftest")  # the engine stand-in: not the plugin at work
collectives: list[tuple[str, list[str]]] = []  # (operation, the plugin's frames on the stack, innermost first)


def plugin_frames() -> list[str]:
    """The plugin's frames on the stack, wherever the collective itself is issued (TRL, accelerate, torch)."""
    return [
        f"{os.path.relpath(frame.filename, PLUGIN_DIR)}:{frame.name}"
        for frame in traceback.extract_stack()[-3::-1]
        if frame.filename.startswith(PLUGIN_DIR) and not frame.filename.startswith(HARNESS_DIR)
    ]


def record_collectives() -> None:
    """Wrap torch.distributed's collectives and TRL's parameter gather: record each call, in order, on this rank."""
    import torch.distributed as dist
    from trl.distributed import DistributedBackend

    def watch(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def watched(*args: Any, **kwargs: Any) -> Any:
            collectives.append((label, plugin_frames()))
            return original(*args, **kwargs)

        setattr(owner, name, watched)

    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "reduce",
        "gather",
        "barrier",
        "all_gather_object",
        "broadcast_object_list",
        "reduce_scatter",
        "all_to_all",
    ):
        watch(dist, name, name)
    watch(DistributedBackend, "gather_params", "gather_params (a collective under ZeRO-3)")


def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: the text to echo
    """
    return text


def main() -> int:
    model_dir, output_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    tool_turns = int((sys.argv[3] if len(sys.argv) > 3 else "2,0").split(",")[rank])
    record_collectives()
    from datasets import Dataset
    from transformers import AutoProcessor
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_5_nothink_chat_template
    from trl.generation import vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM, engine_weights_match, trainer_weights

    processor = AutoProcessor.from_pretrained(model_dir)
    processor.chat_template = processor.tokenizer.chat_template = qwen3_5_nothink_chat_template
    tokenizer = processor.tokenizer
    tool_call = tokenizer(
        "<tool_call>\n<function=echo>\n<parameter=text>\nhi\n</parameter>\n</function>\n</tool_call><|im_end|>",
        add_special_tokens=False,
    )["input_ids"]
    # the two copies of a prompt answer differently, so GRPO's advantages are non-zero and the weights move
    texts = ("ok<|im_end|>", "done, done<|im_end|>")
    answers = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    holder: dict[str, Any] = {}
    rollouts: list[bool] = []
    turns_seen: list[int] = []

    class ScriptedEngine(StandInLLM):
        """Call the tool until this rank's number of tool responses is in the prompt, then answer (the scripted
        tokens get vLLM's processed log-probs, as sampled ones do)."""

        def script(self, prompt_ids: list[int], row: int, sample: int) -> list[int]:
            turns = tokenizer.decode(prompt_ids).count("<tool_response>")
            turns_seen.append(turns)
            return list(tool_call if turns < tool_turns else answers[row % 2])

        def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
            outputs = super().generate(prompts, sampling_params, **kwargs)
            rollouts.append(engine_weights_match(self.rollouts[-1], trainer_weights(holder["trainer"].model)))
            return outputs

    vllm_generation.LLM = ScriptedEngine
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {word}"}] for word in "abcd"]})
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=400,
        max_steps=2,
        learning_rate=0.05,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        ddp_find_unused_parameters=True,  # text-only prompts: the vision tower gets no gradient
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=lambda completions, **_: [float(len(str(c))) for c in completions],
        args=config,
        train_dataset=dataset,
        processing_class=processor,
        tools=[echo],
    )
    holder["trainer"] = trainer
    trainer.train()
    engine = trainer.vllm_generation.llm
    record = json.dumps(
        {
            "rank": rank,
            "steps": trainer.state.global_step,
            "generates": len(rollouts),
            "on_current_weights": sum(rollouts),
            "disk_reloads": engine.disk_reloads,
            "full_pushes": engine.tensor_pushes / sum(1 for _ in trainer.model.parameters()),
            "collectives": collectives,
            "logs": [
                {k: v for k, v in log.items() if k.startswith(("trl_vlm_fixes/", "sampling/"))}
                for log in trainer.state.log_history
            ],
            "tool_turns": turns_seen,
        }
    )
    with open(os.path.join(output_dir, f"rank{rank}.json"), "w") as handle:
        handle.write(record)
    end_program(trainer.accelerator)


if __name__ == "__main__":
    sys.exit(main())
