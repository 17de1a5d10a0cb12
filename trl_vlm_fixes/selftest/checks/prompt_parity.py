"""``prompt_parity``'s self-test check: whether the engine samples image rows from the trainer's prompts."""

from __future__ import annotations

from ..runner import CheckResult, SelftestContext, off_then_on


def check(context: SelftestContext, family: str) -> CheckResult:
    """Two image prompts through TRL's VLLMGeneration to the engine stand-in, whose prompts go through vLLM's own
    multimodal processor: how many rows does the engine sample from another prompt than the trainer's?"""
    from ..fixtures import conversation, make_image
    from ..rollout_schedule import build_generation

    model_dir, processor = context.model_dir(family), context.processor(family)
    images = [make_image(96, 64, 0), make_image(128, 96, 1)]
    prompts = []
    for image in images:
        messages = conversation("what is this?")
        messages[0]["content"][0]["image"] = image
        tokenized = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        prompts.append(list(tokenized["input_ids"][0]))

    def measure() -> tuple[int, str | None]:
        generation = build_generation(model_dir, processor, enable_sleep_mode=False)
        generation.generate(prompts=prompts, images=[[image] for image in images], num_generations=1)
        engine = generation.llm
        return sum(a != b for a, b in zip(engine.prompts_seen, prompts, strict=True)), engine.mm_processing

    def unavailable(processing: str | None) -> str | None:
        return None if processing == "vllm" else f"vLLM's multimodal processor is unavailable here ({processing})"

    def bug(outcome: tuple[int, str | None]) -> tuple[bool | None, str]:
        differing, processing = outcome
        if reason := unavailable(processing):
            return None, reason
        return differing > 0, f"fix off: vLLM samples {differing}/{len(prompts)} image rows from another prompt"

    def fix(outcome: tuple[int, str | None]) -> tuple[bool | None, str]:
        differing, processing = outcome
        if reason := unavailable(processing):
            return None, reason
        return differing == 0, f"fix on: {len(prompts) - differing}/{len(prompts)} rows identical to the trainer's"

    return off_then_on("prompt_parity", measure, bug, fix)
