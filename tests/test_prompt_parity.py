"""prompt_parity on the real trainers: what vLLM's own multimodal processor makes of the prompts TRL sends.

The engine stand-in runs every multimodal prompt through vLLM 0.25.1's real Qwen3.5 processor (``vllm_processor``), so
the prompt ids it reports are the ones a real engine samples from. With the fix off, each image's N pads come back as
2N-1 (the bug); with it on, the engine's prompt is the trainer's, row for row, in colocate and server mode, for mixed
image sizes, several images per prompt, and an image a tool returns.
"""

from __future__ import annotations

import base64
import contextlib
import json
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from helpers import QWEN_FAMILIES, ServerClientStub, counters, module_from_source

from trl_vlm_fixes import metrics
from trl_vlm_fixes.patches import prompt_parity
from trl_vlm_fixes.selftest.engine_standin import StandInLLM
from trl_vlm_fixes.selftest.fixtures import MIXED_SAMPLES, conversation, make_image, mixed_dataset


@pytest.fixture
def recording_engine(monkeypatch: pytest.MonkeyPatch) -> type[StandInLLM]:
    """The stand-in as TRL's colocated engine; each instance is kept, to read the prompts it sampled from."""
    import trl.generation.vllm_generation as vllm_generation

    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    return StandInLLM


def record_trainer_prompts(trainer: Any) -> list[list[int]]:
    """The prompt ids the trainer hands ``VLLMGeneration.generate`` (its own, as it scores them), every call."""
    sent: list[list[int]] = []
    generation = trainer.vllm_generation
    bound = generation.generate  # the class's method, every fix's wrapper included

    def recorder(prompts: list[list[int]], images: Any, *args: Any, **kwargs: Any) -> Any:
        sent.extend(list(ids) for ids in prompts)
        return bound(prompts, images, *args, **kwargs)

    generation.generate = recorder
    return sent


def logged(trainer: Any, name: str) -> list[float]:
    return [log[name] for log in trainer.state.log_history if "loss" in log and name in log]


def image_dataset(images_per_prompt: int = 1) -> Any:
    """The mixed batch (four image sizes, four prompt lengths), with ``images_per_prompt`` images in each prompt."""
    from datasets import Dataset

    if images_per_prompt == 1:
        return mixed_dataset(MIXED_SAMPLES)
    return Dataset.from_dict(
        {
            "prompt": [conversation(text, images_per_prompt) for _, _, text in MIXED_SAMPLES],
            "images": [
                [make_image(w, h, seed + k) for k in range(images_per_prompt)]
                for seed, (w, h, _) in enumerate(MIXED_SAMPLES)
            ],
        }
    )


def colocate_trainer(make_trainer: Any, kind: str, images_per_prompt: int = 1) -> Any:
    return make_trainer(
        kind,
        use_vllm=True,
        vllm_mode="colocate",
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=2,
        dataset=image_dataset(images_per_prompt),
    )


def pad_count(ids: list[int], pad: int) -> int:
    return sum(1 for t in ids if t == pad)


# --- colocate, GRPO and RLOO -----------------------------------------------------------------------------------


@pytest.mark.parametrize("images_per_prompt", [1, 2])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_upstream_engine_samples_from_doubly_expanded_prompts(
    make_trainer: Any, recording_engine: Any, one_fix_off: Any, processor: Any, kind: str, images_per_prompt: int
) -> None:
    """Fix off: every image of N pads reaches the engine as 2N-1 pads; rows with an image of N > 1 differ."""
    one_fix_off("prompt_parity")
    trainer = colocate_trainer(make_trainer, kind, images_per_prompt)
    sent = record_trainer_prompts(trainer)
    trainer.train()
    engine = trainer.vllm_generation.llm
    assert engine.mm_processing == "vllm", engine.mm_processing
    pad = processor.image_token_id
    assert len(sent) == len(engine.prompts_seen) >= 8
    for trainer_ids, engine_ids in zip(sent, engine.prompts_seen, strict=True):
        runs = prompt_parity.count_runs(trainer_ids, pad)
        assert runs == images_per_prompt
        assert pad_count(engine_ids, pad) == 2 * pad_count(trainer_ids, pad) - runs
        assert (engine_ids != trainer_ids) == (pad_count(trainer_ids, pad) > runs)  # a one-pad image survives
    assert sum(a != b for a, b in zip(sent, engine.prompts_seen, strict=True)) >= len(sent) // 2
    assert not logged(trainer, counters.PROMPT_MISMATCH_ROWS.name)  # no fix, no check


@pytest.mark.parametrize("images_per_prompt", [1, 2])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_engine_samples_from_the_trainers_prompt(
    make_trainer: Any, recording_engine: Any, processor: Any, kind: str, images_per_prompt: int
) -> None:
    """Fix on: the engine's prompt ids equal the trainer's, row for row, and the check counts 0 mismatches."""
    trainer = colocate_trainer(make_trainer, kind, images_per_prompt)
    sent = record_trainer_prompts(trainer)
    trainer.train()
    engine = trainer.vllm_generation.llm
    assert engine.mm_processing == "vllm", engine.mm_processing
    assert len(sent) == len(engine.prompts_seen) >= 8
    assert engine.prompts_seen == sent
    sizes = {pad_count(ids, processor.image_token_id) for ids in sent}
    assert len(sizes) >= 3, sizes  # mixed image sizes really reached the engine
    assert logged(trainer, counters.PROMPT_MISMATCH_ROWS.name) == [0.0, 0.0]


# --- a tool that returns an image -------------------------------------------------------------------------------


def look(text: str) -> list[dict[str, Any]]:
    """Look at the scene and return what is seen.

    Args:
        text: what to look at
    """
    return [{"type": "image", "image": make_image(96, 64, 3)}, {"type": "text", "text": f"seen {text}"}]


@pytest.mark.parametrize("fix_on", [False, True])
def test_tool_turn_that_adds_an_image(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any, one_fix_off: Any, fix_on: bool
) -> None:
    """GRPO with a tool whose result holds an image: the second turn's prompt (prompt, completion, tool result with
    its image) reaches the engine as the trainer built it only with the fix."""
    import trl.generation.vllm_generation as vllm_generation
    from transformers import AutoProcessor
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_5_nothink_chat_template

    from trl_vlm_fixes.selftest.fixtures import length_reward

    if not fix_on:
        one_fix_off("prompt_parity")
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    processor.chat_template = processor.tokenizer.chat_template = qwen3_5_nothink_chat_template
    tokenizer = processor.tokenizer
    call = "<tool_call>\n<function=look>\n<parameter=text>\nsky\n</parameter>\n</function>\n</tool_call><|im_end|>"
    tool_call = tokenizer(call, add_special_tokens=False)["input_ids"]
    answer = tokenizer("blue<|im_end|>", add_special_tokens=False)["input_ids"]

    class ScriptedEngine(StandInLLM):
        """Calls the tool once per rollout, then answers (its log-probs for those tokens are vLLM's)."""

        def script(self, prompt_ids: list[int], row: int, sample: int) -> list[int]:
            turn = tokenizer.decode(prompt_ids).count("<tool_response>")
            return list(tool_call if turn == 0 else answer)

    monkeypatch.setattr(vllm_generation, "LLM", ScriptedEngine, raising=False)
    config = GRPOConfig(
        output_dir=str(tmp_path / "tools"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=256,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        use_vllm=True,
        vllm_mode="colocate",
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=length_reward,
        args=config,
        train_dataset=mixed_dataset(MIXED_SAMPLES[:2]),
        processing_class=processor,
        tools=[look],
    )
    sent = record_trainer_prompts(trainer)
    trainer.train()
    engine = trainer.vllm_generation.llm
    pad = processor.image_token_id
    tool_turns = [i for i, ids in enumerate(sent) if "<tool_response>" in tokenizer.decode(ids)]
    assert tool_turns and engine.mm_processing == "vllm"
    for i in tool_turns:
        assert prompt_parity.count_runs(sent[i], pad) == 2  # the prompt's image and the tool's
        assert (engine.prompts_seen[i] == sent[i]) is fix_on
    assert (engine.prompts_seen == sent) is fix_on


# --- server mode: the request the client sends ------------------------------------------------------------------


def test_server_request_carries_one_pad_per_image(
    make_trainer: Any, processor: Any, tiny_model_dir: Path, monkeypatch: Any
) -> None:
    """TRL 1.9.1's client sends ids and images as JSON to `trl vllm-serve`, which builds the same vLLM rows as
    colocate: the request holds one pad per image, and the prompt vLLM reports is the trainer's."""
    import trl.generation.vllm_generation as vllm_generation
    from PIL import Image

    if "server" not in prompt_parity.modes_sending_expanded_ids(vllm_generation.VLLMGeneration.generate):
        pytest.skip("this TRL's server mode sends processed image features with the expanded ids: nothing to collapse")
    engine = StandInLLM(str(tiny_model_dir))
    requests: list[dict[str, Any]] = []

    class Server(ServerClientStub):
        """`trl vllm-serve`'s /generate/ on the stand-in: base64 images through JSON, rows built as vllm_serve does."""

        def generate(self, prompts: list[list[int]], images: Any = None, n: int = 1, **kwargs: Any) -> Any:
            def encode(image: Any) -> str:
                buffer = BytesIO()
                image.save(buffer, format="PNG")
                return base64.b64encode(buffer.getvalue()).decode()

            body = json.loads(json.dumps({"prompts": prompts, "images": [[encode(i) for i in row] for row in images]}))
            requests.append(body)
            rows = [
                {
                    "prompt_token_ids": ids,
                    "multi_modal_data": {"image": [Image.open(BytesIO(base64.b64decode(i))) for i in imgs]},
                }
                for ids, imgs in zip(body["prompts"], body["images"], strict=True)
            ]
            outputs = engine.generate(rows, kwargs.get("sampling_params"))
            return {
                "prompt_ids": [o.prompt_token_ids for o in outputs],
                "completion_ids": [[70, 71, 72, 73] for _ in outputs for _ in range(n)],
                "logprobs": [[[-5.57]] * 4 for _ in outputs for _ in range(n)],
                "logprob_token_ids": [[[t] for t in (70, 71, 72, 73)] for _ in outputs for _ in range(n)],
            }

    monkeypatch.setattr(vllm_generation, "VLLMClient", Server, raising=False)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *a, **k: True)
    trainer = make_trainer(
        "grpo",
        use_vllm=True,
        vllm_mode="server",
        max_steps=2,
        per_device_train_batch_size=8,
        vllm_importance_sampling_correction=False,
        dataset=mixed_dataset(MIXED_SAMPLES),
    )
    sent = record_trainer_prompts(trainer)
    trainer.train()
    pad = processor.image_token_id
    assert requests and all(row.count(pad) == 1 for request in requests for row in request["prompts"])
    assert engine.mm_processing == "vllm"
    trainer_rows = sent[::2]  # the server generates each prompt once, n times
    assert engine.prompts_seen == trainer_rows
    assert logged(trainer, counters.PROMPT_MISMATCH_ROWS.name) == [0.0, 0.0]


# --- the parity check ------------------------------------------------------------------------------------------


def test_a_processor_setting_the_engine_never_got_is_counted_and_logged_once(
    make_trainer: Any, recording_engine: Any, caplog: Any, monkeypatch: Any
) -> None:
    """The trainer's processor resizes images smaller than the engine's (max_pixels set on the trainer's side only):
    every image row differs, is counted, and one line names the row, both lengths and the cause."""
    from trl_vlm_fixes import log_once

    monkeypatch.setattr(log_once, "_said", set())
    trainer = colocate_trainer(make_trainer, "grpo")
    trainer.processing_class.image_processor.max_pixels = 32 * 32
    trainer.processing_class.image_processor.size = {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}
    sent = record_trainer_prompts(trainer)
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
        trainer.train()
    engine = trainer.vllm_generation.llm
    differing = sum(a != b for a, b in zip(sent, engine.prompts_seen, strict=True))
    assert differing > 0
    assert sum(logged(trainer, counters.PROMPT_MISMATCH_ROWS.name)) == differing
    lines = [r.getMessage() for r in caplog.records if "prompt_parity: vLLM sampled" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "resize differently" in lines[0] and "vLLM " in lines[0] and "trainer " in lines[0]


def test_check_names_each_cause() -> None:
    trainer = [[1, 5, 5, 5, 2], [1, 7, 2], [1, 5, 5, 2, 5, 2]]
    doubled = [1, 5, 5, 5, 5, 5, 2]
    cause = prompt_parity.likely_cause(doubled, trainer, row=0, images=1, pad_id=5, rewritten=False)
    assert "a second time" in cause
    cause = prompt_parity.likely_cause([1, 5, 5, 2], trainer, row=0, images=1, pad_id=5, rewritten=True)
    assert "resize differently" in cause and "save_pretrained" in cause
    cause = prompt_parity.likely_cause(trainer[1], trainer, row=0, images=1, pad_id=5, rewritten=True)
    assert "another row's prompt" in cause
    cause = prompt_parity.likely_cause([1, 5, 5, 5, 2, 5, 5, 2], trainer, row=2, images=1, pad_id=5, rewritten=False)
    assert "2 image pad runs for 1 images" in cause
    assert prompt_parity.mismatched_rows([doubled, [1, 7, 2]], trainer[:2]) == [0]
    assert prompt_parity.mismatched_rows(None, trainer) == [0, 1, 2]
    # TRL 1.9.1's server mode pairs a row with the first of its group, which may be another rank's: not a row of this
    # rank, another text, no expansion between them
    other_rank = [1, 9, 9, 5, 2]
    cause = prompt_parity.likely_cause(other_rank, trainer, row=1, images=0, pad_id=5, rewritten=True, server=True)
    assert "another row's prompt" in cause and "another rank" in cause
    cause = prompt_parity.likely_cause(other_rank, trainer, row=1, images=0, pad_id=5, rewritten=True, server=False)
    assert "upstream change" in cause


def test_a_callers_unexpanded_placeholders_are_no_mismatch() -> None:
    """A rollout_func that sends each image as one pad gets vLLM's expansion back: the prompt it meant, not a
    mismatch, when each pad became what the trainer's processor gives its image. A row that held expanded pads, an
    expansion to another size, or an image of a single token (its one pad is already its expansion) still is one."""
    sent = [[1, 5, 2, 3], [1, 5, 2, 5, 3], [1, 5, 5, 2], [1, 5, 2], [1, 5, 2]]
    engine = [[1, 5, 5, 5, 2, 3], [1, 5, 5, 2, 5, 5, 5, 3], [1, 5, 5, 5, 2], [1, 5, 5, 5, 5, 2], [1, 5, 5, 2]]
    tokens = {0: [3], 1: [2, 3], 2: [3], 3: [3], 4: [1]}  # what the trainer's processor gives each row's images
    assert prompt_parity.mismatched_rows(engine, sent, 5, tokens.get) == [2, 3, 4]
    assert prompt_parity.mismatched_rows(engine, sent, 5) == [0, 1, 2, 3, 4]  # unknown sizes: compared as they are


def test_a_rollout_funcs_one_pad_per_image_prompt_is_checked_against_the_trainers_processor(
    make_generation: Any, recording_engine: Any, processor: Any
) -> None:
    """Through TRL's VLLMGeneration and vLLM's own processor: a caller's unexpanded prompt is no mismatch."""
    generation = make_generation(enable_sleep_mode=False)
    image = make_image(96, 64)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]  # one pad: not expanded
    assert ids.count(processor.image_token_id) == 1
    generation.generate(prompts=[ids], images=[[image]], num_generations=1)
    assert generation.llm.prompts_seen[0].count(processor.image_token_id) > 1  # vLLM expanded it
    assert metrics.drain(generation) == {counters.PROMPT_MISMATCH_ROWS.name: 0.0}


def test_prompts_of_other_types_are_checked_or_named(
    make_generation: Any, recording_engine: Any, caplog: Any, monkeypatch: Any
) -> None:
    """A rollout_func may pass tuples or tensors: they are read as id lists and checked; anything else is named."""
    import torch

    from trl_vlm_fixes import log_once

    monkeypatch.setattr(log_once, "_said", set())
    generation = make_generation(enable_sleep_mode=False)
    generation.generate(prompts=[(1, 2, 3), torch.tensor([4, 5])], images=None, num_generations=1)
    assert metrics.drain(generation) == {counters.PROMPT_MISMATCH_ROWS.name: 0.0}
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"), contextlib.suppress(Exception):  # the engine's to judge
        generation.generate(prompts="not ids", images=None, num_generations=1)
    assert any("cannot read prompts of type str" in r.getMessage() for r in caplog.records)


def test_collapse_keeps_everything_but_repeated_pads() -> None:
    ids = [9, 7, 5, 5, 5, 8, 1, 7, 5, 8, 5, 5]
    assert prompt_parity.collapse_runs(ids, 5) == [9, 7, 5, 8, 1, 7, 5, 8, 5]
    assert prompt_parity.count_runs(ids, 5) == 3
    sent, left = prompt_parity.unexpanded_prompts([ids, ids, [1, 2]], [[0, 0, 0], [0], None], 5)
    assert sent == [prompt_parity.collapse_runs(ids, 5), ids, [1, 2]] and left == [1]


# --- scope ----------------------------------------------------------------------------------------------------


def test_steps_aside_for_a_model_with_another_rope_index_with_one_line(
    make_generation: Any, recording_engine: Any, processor: Any, caplog: Any, monkeypatch: Any
) -> None:
    """A model whose image expansion it is not proven on (another get_rope_index): prompts go to vLLM as TRL built
    them (one line says why), and the check still counts the rows vLLM expanded again."""
    from trl_vlm_fixes import log_once

    monkeypatch.setattr(log_once, "_said", set())
    generation = make_generation(enable_sleep_mode=False)
    backbone = type(generation.model.model)
    original = backbone.get_rope_index
    monkeypatch.setattr(backbone, "get_rope_index", lambda self, *a, **k: original(self, *a, **k))
    messages = [
        {"role": "user", "content": [{"type": "image", "image": make_image(96, 64)}, {"type": "text", "text": "hi"}]}
    ]
    ids = list(
        processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ][0]
    )
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
        for _ in range(2):
            generation.generate(prompts=[ids], images=[[make_image(96, 64)]], num_generations=1)
    assert generation.llm.prompts_seen[0] != ids
    aside = [r.getMessage() for r in caplog.records if "sends vLLM the prompts as TRL built them" in r.getMessage()]
    assert len(aside) == 1 and "another get_rope_index" in aside[0]
    mismatch = [r.getMessage() for r in caplog.records if "vLLM sampled" in r.getMessage()]
    assert len(mismatch) == 1 and "a second time" in mismatch[0]
    assert metrics.drain(generation) == {counters.PROMPT_MISMATCH_ROWS.name: 2.0}


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_every_qwen_family_reaches_the_engine_unchanged(
    family_model_dir: Any, recording_engine: Any, one_fix_off: Any, family: str
) -> None:
    """Every Qwen family, dense and MoE, through TRL's VLLMGeneration and vLLM's own processor for each: two images
    of other sizes in one prompt, doubly expanded with the fix off, identical with it on."""
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.rollout_schedule import build_generation

    model_dir = family_model_dir(family)
    processor = AutoProcessor.from_pretrained(model_dir)
    images = [make_image(96, 64, 0), make_image(128, 96, 1)]
    messages = conversation("two pictures", 2)
    for part, image in zip(messages[0]["content"], images, strict=False):
        part["image"] = image
    tokenized = processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    ids = list(tokenized["input_ids"][0])
    seen = []
    for fix_on in (True, False):
        if not fix_on:
            one_fix_off("prompt_parity")
        generation = build_generation(model_dir, processor, enable_sleep_mode=False)
        generation.generate(prompts=[ids], images=[images], num_generations=1)
        assert generation.llm.mm_processing == "vllm"
        seen.append(generation.llm.prompts_seen[0])
    pad = processor.image_token_id
    assert prompt_parity.count_runs(ids, pad) == 2 and pad_count(ids, pad) > 2
    assert seen[0] == ids
    assert pad_count(seen[1], pad) == 2 * pad_count(ids, pad) - 2


def test_text_prompts_pass_untouched(make_generation: Any, recording_engine: Any) -> None:
    generation = make_generation(enable_sleep_mode=False)
    generation.generate(prompts=[[1, 2, 3], [4, 5]], images=None, num_generations=1)
    assert generation.llm.prompts_seen == [[1, 2, 3], [4, 5]]
    assert metrics.drain(generation) == {counters.PROMPT_MISMATCH_ROWS.name: 0.0}


def test_installed_trl_sends_expanded_ids_where_expected() -> None:
    """TRL 1.9.1: colocate and server mode send the processor-expanded ids with raw images. TRL >= 1.11 serves
    server mode with processed image features placed on the expanded ids: colocate only."""
    import inspect

    from trl.generation.vllm_generation import VLLMGeneration

    server_sends_features = "features=" in inspect.getsource(VLLMGeneration.generate)  # TRL >= 1.11's server path
    expected = {"colocate"} if server_sends_features else {"colocate", "server"}
    assert prompt_parity.modes_sending_expanded_ids(VLLMGeneration.generate) == expected


def test_not_needed_where_trl_sends_no_expanded_token_prompt(tmp_path: Path) -> None:
    """A TRL whose generate sends text prompts with images (vLLM expands them once) needs no rewrite."""
    source = (
        "class VLLMGeneration:\n"
        "    def generate(self, prompts, images, num_generations, profiler=None):\n"
        "        rows = [{'prompt': p, 'multi_modal_data': {'image': i}} for p, i in zip(prompts, images)]\n"
        "        return self.llm.generate(rows)\n"
    )
    with module_from_source(tmp_path, "drifted_generation", source) as module:
        reason = prompt_parity._upstream_sends_unexpanded(module.VLLMGeneration.generate)
    assert reason and "no processor-expanded token prompt" in reason
    from trl.generation.vllm_generation import VLLMGeneration

    assert prompt_parity._upstream_sends_unexpanded(VLLMGeneration.generate) is None
