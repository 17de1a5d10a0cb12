"""vision_token_guard on the real trainers: a tiny Qwen3.5 VLM whose lm_head loves its vision placeholder tokens.

Without the guard a step crashes at scoring; with it no completion holds a placeholder (ban), and where one still gets
through (ban off) its row is masked out of the loss and counted, never a crash.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import QWEN_FAMILIES, ServerClientStub, counters, upstream_suppresses_image_token

from trl_vlm_fixes import metrics
from trl_vlm_fixes.selftest.tiny_model import SPECIAL_TOKENS

PLACEHOLDERS = SPECIAL_TOKENS[3:]  # vision start/end, image pad, video pad
CRASH = r"Image features and image tokens do not match|not an iterator|shape mismatch|do not match"


@pytest.fixture(scope="session")
def loving_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 VLM with its placeholder rows of lm_head scaled 50x: about half of the mass it samples from
    is on them, so most completions hold one (through vLLM's own Sampler behind the engine stand-in too)."""
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("placeholder-loving"), placeholder_scale=50.0)


@pytest.fixture(scope="session")
def realistic_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A peaked policy (logits of std ~2) whose placeholders get about 1e-3 of the mass per token, as a trained one."""
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("realistic"), sharpness=20.0, placeholder_scale=0.0)


def placeholder_ids(processor: Any) -> set[int]:
    return {processor.tokenizer.convert_tokens_to_ids(token) for token in PLACEHOLDERS}


def loving_trainer(model_dir: Path, tmp_path: Path, kind: str, **overrides: Any) -> Any:
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.fixtures import build_trainer

    processor = AutoProcessor.from_pretrained(model_dir)
    return build_trainer(model_dir, processor, str(tmp_path / kind), kind, **{"max_steps": 3, **overrides})


def record_rollouts(trainer: Any) -> list[dict[str, Any]]:
    """What TRL's scoring pass received (its `_generate_and_score_completions` outputs), per rollout."""
    outputs: list[dict[str, Any]] = []
    bound = trainer._generate_and_score_completions

    def recorder(inputs: Any) -> Any:
        output = bound(inputs)
        outputs.append(output)
        return output

    trainer._generate_and_score_completions = recorder
    return outputs


def record_raw_samples(trainer: Any) -> list[list[int]]:
    """The completions as sampled, before the guard's safety net looks at them."""
    rows: list[list[int]] = []
    bound = trainer._generate_single_turn

    def recorder(*args: Any, **kwargs: Any) -> Any:
        result = bound(*args, **kwargs)
        completion_ids = result[0] if isinstance(result, tuple) else result
        rows.extend(list(ids) for ids in completion_ids)
        return result

    trainer._generate_single_turn = recorder
    return rows


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """The tokens a scored batch trains on (GRPO multiplies in its tool mask)."""
    mask: torch.Tensor = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def metric_values(trainer: Any) -> list[float]:
    return [log[counters.VISION_TOKEN_ROWS_MASKED.name] for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_placeholder_loving_policy_breaks_the_run_without_the_guard(
    loving_model_dir: Path, tmp_path: Path, one_fix_off: Any, kind: str
) -> None:
    """TRL 1.9.1: the scoring pass crashes. TRL >= 1.16 suppresses the image pad itself (transformers path only): the
    run goes on, but the other placeholders (video pad, vision start/end) reach the model as if they were text."""
    one_fix_off("vision_token_guard")
    trainer = loving_trainer(loving_model_dir, tmp_path, kind)
    if not upstream_suppresses_image_token():
        with pytest.raises((TypeError, ValueError, RuntimeError), match=CRASH):
            trainer.train()
        return
    banned = placeholder_ids(trainer.processing_class)
    rollouts = record_rollouts(trainer)
    trainer.train()
    assert any(banned & set(row.tolist()) for output in rollouts for row in output["completion_ids"])


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_every_family_crashes_without_the_guard_and_trains_with_it(
    family: str,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    one_fix_off: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every Qwen family, dense and MoE, with a policy that loves its placeholders (through vLLM's Sampler, colocate):
    upstream, sampled placeholders reach the scoring pass (which crashes on an image pad, or scores the others as
    text); with the guard no completion holds one and the run trains."""
    import trl.generation.vllm_generation as vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    model_dir = build_tiny_qwen35_vlm(tmp_path_factory.mktemp(f"loving-{family}"), family=family, placeholder_scale=50)
    settings = {"use_vllm": True, "vllm_mode": "colocate", "max_steps": 1}
    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    trainer = loving_trainer(model_dir, tmp_path / "on", "grpo", **settings)
    banned = placeholder_ids(trainer.processing_class)
    rollouts = record_rollouts(trainer)
    trainer.train()
    assert trainer.state.global_step == 1 and metric_values(trainer) == [0.0]
    assert not any(banned & set(row.tolist()) for output in rollouts for row in output["completion_ids"])
    one_fix_off("vision_token_guard")
    upstream = loving_trainer(model_dir, tmp_path / "off", "grpo", **settings)
    upstream_rollouts = record_rollouts(upstream)
    try:
        upstream.train()
    except (TypeError, ValueError, RuntimeError) as error:  # a sampled image pad: the scoring pass crashes
        assert re.search(CRASH, str(error)), error
    else:  # other placeholders (vision start/end, video pad) are scored as if they were text, silently
        assert any(banned & set(row.tolist()) for output in upstream_rollouts for row in output["completion_ids"])


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_guard_bans_placeholders_and_training_runs(loving_model_dir: Path, tmp_path: Path, kind: str) -> None:
    trainer = loving_trainer(loving_model_dir, tmp_path, kind)
    banned = placeholder_ids(trainer.processing_class)
    raw = record_raw_samples(trainer)
    suppressed_before = trainer.generation_config.suppress_tokens
    trainer.train()
    assert trainer.state.global_step == 3
    assert raw and not any(banned & set(row) for row in raw)  # the sampler never produced one
    assert metric_values(trainer) == [0.0, 0.0, 0.0]
    assert trainer.generation_config.suppress_tokens == suppressed_before  # nothing left on the trainer


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_safety_net_masks_and_counts_rows_when_the_ban_is_off(
    loving_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    with_setting: Callable[[str, str], None],
    kind: str,
    caplog: Any,
) -> None:
    from trl_vlm_fixes import log_once

    with_setting("TRL_VLM_FIXES_VISION_TOKEN_GUARD_BAN", "0")
    monkeypatch.setattr(log_once, "_said", set())  # the first occurrence in this process warns
    trainer = loving_trainer(loving_model_dir, tmp_path, kind)
    banned = placeholder_ids(trainer.processing_class)
    raw = record_raw_samples(trainer)
    rollouts = record_rollouts(trainer)
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
        trainer.train()
    assert trainer.state.global_step == 3
    stray_rows = sum(bool(banned & set(row)) for row in raw)
    assert stray_rows > 0, "the loving model sampled no placeholder: the test shows nothing"
    assert sum(metric_values(trainer)) == stray_rows
    masked = sum(int((loss_mask(output).sum(dim=1) == 0).sum()) for output in rollouts)
    assert masked == stray_rows
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    for output in rollouts:  # no placeholder reaches the model in a completion
        assert not any(banned & set(row.tolist()) for row in output["completion_ids"])
    # the guard's own line (the trainer-start line also names vision_token_guard when this is the first trainer)
    messages = [r.getMessage() for r in caplog.records]
    warnings = [message for message in messages if message.startswith("trl_vlm_fixes.vision_token_guard:")]
    assert warnings and any(token in warnings[0] for token in PLACEHOLDERS)


def upstream_imports_vllm() -> bool:
    import trl.generation.vllm_generation as vllm_generation

    return getattr(vllm_generation, "SamplingParams", None).__module__.startswith("vllm")  # type: ignore[union-attr]


def test_vllm_colocate_request_carries_the_ban(loving_model_dir: Path, tmp_path: Path, monkeypatch: Any) -> None:
    import trl.generation.vllm_generation as vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM

    requests: list[Any] = []

    class LovingEngine(StandInLLM):
        """Samples the loving policy through vLLM's Sampler: without the ban most rows would hold a placeholder."""

        def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
            requests.append(sampling_params)
            return super().generate(prompts, sampling_params, **kwargs)

    monkeypatch.setattr(vllm_generation, "LLM", LovingEngine, raising=False)
    user_bias = {65: 1.5}
    trainer = loving_trainer(
        loving_model_dir,
        tmp_path,
        "grpo",
        use_vllm=True,
        vllm_mode="colocate",
        generation_kwargs={"logit_bias": user_bias, "top_k": 5},
    )
    placeholders = placeholder_ids(trainer.processing_class)
    assert {261, 259} <= placeholders
    rollouts = record_rollouts(trainer)
    trainer.train()
    assert trainer.state.global_step == 3 and metric_values(trainer) == [0.0, 0.0, 0.0]
    assert not any({261, 259} & set(row.tolist()) for output in rollouts for row in output["completion_ids"])
    # the batched ban (vLLM's own SamplingParams where vLLM imports): -inf on every placeholder, the user's bias kept,
    # and no per-request bad_words left to run in Python at every decode step
    assert requests and all(type(r).__module__.startswith("vllm") for r in requests) == upstream_imports_vllm()
    for request in requests:
        assert request.logit_bias == {65: 1.5, **dict.fromkeys(placeholders, float("-inf"))}
        assert not request.bad_words and request.top_k == 5
    assert trainer.vllm_generation.generation_kwargs == {"logit_bias": user_bias, "top_k": 5}  # restored


def test_vllm_colocate_without_the_guard_crashes(  # TRL bans nothing on the vLLM path, 1.16 included
    loving_model_dir: Path, tmp_path: Path, monkeypatch: Any, one_fix_off: Any
) -> None:
    import trl.generation.vllm_generation as vllm_generation

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM

    one_fix_off("vision_token_guard")
    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    trainer = loving_trainer(loving_model_dir, tmp_path, "grpo", use_vllm=True, vllm_mode="colocate")
    with pytest.raises((TypeError, ValueError, RuntimeError), match=CRASH):
        trainer.train()


def test_server_mode_request_carries_the_ban_as_json(loving_model_dir: Path, tmp_path: Path, monkeypatch: Any) -> None:
    """Server mode: the ban travels in the request's generation_kwargs, through JSON, and the user's own stay."""
    import trl.generation.vllm_generation as vllm_generation
    from datasets import Dataset

    requests: list[dict[str, Any]] = []

    class FakeServer(ServerClientStub):
        """Stands in for `trl vllm-serve`: answers over 'JSON', samples the image pad unless the request bans it."""

        def generate(self, prompts: list[list[int]], n: int = 1, **kwargs: Any) -> dict[str, Any]:
            request = json.loads(json.dumps({"generation_kwargs": kwargs.get("generation_kwargs") or {}}))
            requests.append(request)
            image_pad = "<|image_pad|>" in (request["generation_kwargs"].get("bad_words") or [])
            token = 65 if image_pad else 261
            completions = [[70, token, 71, 72] for _ in prompts for _ in range(n)]
            return {
                "prompt_ids": prompts,
                "completion_ids": completions,
                "logprobs": [[[-5.57]] * 4 for _ in completions],
                "logprob_token_ids": [[[t] for t in c] for c in completions],
            }

    monkeypatch.setattr(vllm_generation, "VLLMClient", FakeServer, raising=False)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *a, **k: True)
    trainer = loving_trainer(
        loving_model_dir,
        tmp_path,
        "grpo",
        use_vllm=True,
        vllm_mode="server",
        generation_kwargs={"bad_words": ["hello"], "top_k": 5},
        vllm_importance_sampling_correction=False,
        # text prompts: the request's token ban is what is checked (TRL >= 1.16 also ships images to the server)
        dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": w}] for w in ("a", "bb", "ccc", "dddd")]}),
    )
    trainer.train()
    assert trainer.state.global_step == 3 and requests
    for request in requests:
        bad_words = request["generation_kwargs"]["bad_words"]
        assert bad_words[0] == "hello" and set(PLACEHOLDERS) <= set(bad_words)
        assert request["generation_kwargs"]["top_k"] == 5
    assert metric_values(trainer) == [0.0, 0.0, 0.0]


def test_text_only_trainer_is_left_alone_with_one_log_line(caplog: Any, monkeypatch: Any) -> None:
    from types import SimpleNamespace

    from trl_vlm_fixes import log_once
    from trl_vlm_fixes.patches import vision_token_guard

    monkeypatch.setattr(log_once, "_said", set())
    text_only = SimpleNamespace(processing_class=SimpleNamespace())  # a plain tokenizer-less processing class
    calls: list[str] = []
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
        for _ in range(2):
            out = vision_token_guard.rollout_wrapper(lambda: calls.append("x") or ("p", [[1]]), text_only, (), {})
    assert out == ("p", [[1]]) and calls == ["x", "x"]
    assert sum("steps aside" in r.getMessage() for r in caplog.records) == 1


# --- a masked row is out of the loss, its normaliser and the advantages ------------------------------------------


def one_bad_row_trainer(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    with_setting: Callable[[str, str], None],
) -> Any:
    """Ban off, one group of 4 completions of 256 tokens from the engine stand-in: row 0 holds the image pad (261)."""
    import trl.generation.vllm_generation as vllm_generation
    from datasets import Dataset

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM

    class Engine(StandInLLM):
        """Row r's completion is scripted: 256 tokens, the second one the image pad (261) in row 0 alone; vLLM's
        processed log-probs of them are reported, as for sampled tokens."""

        def script(self, prompt_ids: list[int], row: int, sample: int) -> list[int]:
            tokens = [32 + (7 * row + i) % 90 for i in range(256)]
            tokens[1] = (261, 70, 71, 72)[row % 4]
            return tokens

    with_setting("TRL_VLM_FIXES_VISION_TOKEN_GUARD_BAN", "0")
    monkeypatch.setattr(vllm_generation, "LLM", Engine, raising=False)
    trainer = loving_trainer(
        model_dir,
        tmp_path,
        kind,
        use_vllm=True,
        vllm_mode="colocate",
        num_generations=4,
        max_completion_length=256,
        dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "describe"}]]}),
    )
    trainer.reward_funcs = [scores_the_bad_row_highest]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, read by GRPO's loss
    return trainer


def scores_the_bad_row_highest(completions: list[Any], **_: Any) -> list[float]:
    """Row 0 far above its siblings: in their group baseline, it would shift every advantage."""
    return [10.0, 0.0, 1.0, 2.0]


def rows_of(batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The scored batch restricted to ``rows`` (text prompts: every tensor of the batch is per row, or a scalar)."""
    size = batch["completion_ids"].shape[0]
    return {k: v[rows] if torch.is_tensor(v) and v.dim() and v.shape[0] == size else v for k, v in batch.items()}


def loss_and_grads(trainer: Any, batch: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.item(), grads


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_masked_row_is_out_of_loss_normaliser_and_advantages(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    with_setting: Callable[[str, str], None],
    kind: str,
    caplog: Any,
) -> None:
    """The other rows train as if the bad row were not in the batch; no NaN from it.

    Before: RLOO's ``old_logps`` kept the masked row's -1400 nats, the loss's ``exp`` gave inf (NaN gradients on TRL
    1.9.1); GRPO's ``num_items_in_batch`` counted the masked tokens, scaling the other rows' gradient by 3/4; both put
    the bad row in its group's baseline (the good rows' advantages did not sum to 0)."""
    trainer = one_bad_row_trainer(tiny_model_dir, tmp_path, monkeypatch, kind, with_setting)
    banned = placeholder_ids(trainer.processing_class)
    raw = record_raw_samples(trainer)
    with caplog.at_level("WARNING"):
        batch = trainer._generate_and_score_completions([{"prompt": [{"role": "user", "content": "describe"}]}] * 4)
    assert not any("reward functions returned None" in r.getMessage() for r in caplog.records)  # TRL's, not for us
    assert [bool(banned & set(row)) for row in raw] == [True, False, False, False]
    assert batch["completion_ids"].shape[1] >= 254 and not banned & set(batch["completion_ids"].flatten().tolist())
    good = [1, 2, 3]

    advantages = batch["advantages"]
    assert advantages[0].item() == 0.0
    assert advantages[good].sum().item() == pytest.approx(0.0, abs=1e-4)  # centred on the good rows alone
    assert advantages[good].abs().max().item() > 0.5  # the test has a signal
    assert loss_mask(batch)[0].sum().item() == 0
    if kind == "grpo":  # dapo's normaliser: the tokens TRL gathered from the loss mask
        assert batch["num_items_in_batch"].item() == loss_mask(batch)[good].sum().item()

    loss, grads = loss_and_grads(trainer, batch)
    assert torch.isfinite(torch.tensor(loss)) and all(torch.isfinite(g).all() for g in grads.values())

    reference = rows_of(batch, good)
    if kind == "grpo":
        reference["num_items_in_batch"] = loss_mask(reference).sum()
    _, expected = loss_and_grads(trainer, reference)
    # RLOO averages its loss over the device batch (rloo_trainer.py `per_sequence_loss.mean()`): the masked row is a
    # zero term there, as TRL's own unscorable rows are; GRPO's dapo sums tokens over the gathered token count.
    scale = 3 / 4 if kind == "rloo" else 1.0
    assert grads.keys() == expected.keys()
    # float32 sums in another batch order: a tolerance on the gradient's scale (a few terms cancel to ~1e-5 of it)
    tolerance = 1e-5 * max(g.abs().max().item() for g in expected.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, scale * expected[name], rtol=1e-4, atol=tolerance, msg=name)


def test_masked_rows_score_none_in_every_kind_of_reward_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sync and async functions return None there, a reward model NaN; functions, hooks and log filter put back."""
    import asyncio
    import inspect
    import logging
    from types import SimpleNamespace

    from trl_vlm_fixes.patches import vision_token_guard

    class RewardModel(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> Any:
            return SimpleNamespace(logits=input_ids.float().unsqueeze(1))

    def sync_reward(**_: Any) -> list[float]:
        return [1.0, 2.0, 3.0]

    async def async_reward(**_: Any) -> list[float]:
        return [1.0, 2.0, 3.0]

    class Trainer:
        reward_funcs = [sync_reward, async_reward, RewardModel()]

    trainer = Trainer()
    original = list(trainer.reward_funcs)
    vision_token_guard._masked_rows.set(trainer, [1])

    def calculate_rewards() -> tuple[Any, ...]:  # what TRL's _calculate_rewards does with each kind
        scored, unscored_async, model = trainer.reward_funcs
        assert isinstance(model, torch.nn.Module) and inspect.iscoroutinefunction(unscored_async)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([1, 2, 3])).logits[:, 0]
        return scored(), asyncio.run(unscored_async()), logits.tolist()

    scored, scored_async, logits = vision_token_guard.rewards_wrapper(calculate_rewards, trainer, (), {})
    assert scored == scored_async == [1.0, None, 3.0]
    assert logits[0] == 1.0 and logits[2] == 3.0 and logits[1] != logits[1]  # NaN
    assert trainer.reward_funcs == original and not original[2]._forward_hooks
    assert not logging.getLogger(calculate_rewards.__module__).filters


def test_server_engine_gets_the_placeholder_words_as_the_batched_ban(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In `trl vllm-serve`'s worker (TRL's vllm_serve.py on the stack, under any module name), the placeholder words
    the trainer's request carries in `bad_words` reach vLLM's real SamplingParams as -inf `logit_bias` (batched);
    the user's own words and biases stay, and an engine outside the server is left as the request came."""
    import types

    pytest.importorskip("vllm")
    import trl.scripts.vllm_serve as vllm_serve
    import vllm.entrypoints.llm as llm_module
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    layer = vars(llm_module.LLM)["generate"]
    while type(layer.__wrapped__) is not types.FunctionType:  # below every fix's wrapper (type(): proxies lie)
        layer = layer.__wrapped__
    received: list[Any] = []
    monkeypatch.setattr(
        layer, "__wrapped__", lambda self, prompts, sampling_params=None, **_: received.append(sampling_params)
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = object.__new__(llm_module.LLM)
    engine.get_tokenizer = lambda: tokenizer  # type: ignore[method-assign]

    def request() -> Any:  # what the trainer's guard sends through JSON
        return SamplingParams(bad_words=["hello", *PLACEHOLDERS], logit_bias={65: 1.0}, max_tokens=4)

    worker = "def llm_worker(llm, params):\n    return llm.generate(['x'], sampling_params=params)\n"
    for name in ("__main__", "__mp_main__"):
        namespace: dict[str, Any] = {"__name__": name}
        exec(compile(worker, vllm_serve.__file__, "exec"), namespace)
        namespace["llm_worker"](engine, request())
    engine.generate(["x"], sampling_params=request())  # a user's own engine
    placeholder_ids = {tokenizer.convert_tokens_to_ids(token) for token in PLACEHOLDERS}
    for served in received[:2]:
        assert served.bad_words == ["hello"]
        assert served.logit_bias == {65: 1.0, **dict.fromkeys(placeholder_ids, float("-inf"))}
    assert received[2].bad_words == ["hello", *PLACEHOLDERS] and received[2].logit_bias == {65: 1.0}


def test_server_engine_decoding_speculatively_keeps_the_words(tiny_model_dir: Path, monkeypatch: Any) -> None:
    """vLLM 0.25.1 refuses any logit_bias with speculative decoding: such a server keeps the request's bad_words."""
    import types

    pytest.importorskip("vllm")
    import trl.scripts.vllm_serve as vllm_serve
    import vllm.entrypoints.llm as llm_module
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    layer = vars(llm_module.LLM)["generate"]
    while type(layer.__wrapped__) is not types.FunctionType:
        layer = layer.__wrapped__
    received: list[Any] = []
    monkeypatch.setattr(
        layer, "__wrapped__", lambda self, prompts, sampling_params=None, **_: received.append(sampling_params)
    )
    engine = object.__new__(llm_module.LLM)
    engine.get_tokenizer = lambda: AutoTokenizer.from_pretrained(tiny_model_dir)  # type: ignore[method-assign]
    engine.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(speculative_config={"method": "mtp"}))
    namespace: dict[str, Any] = {"__name__": "__main__"}
    worker = "def llm_worker(llm, params):\n    return llm.generate(['x'], sampling_params=params)\n"
    exec(compile(worker, vllm_serve.__file__, "exec"), namespace)
    namespace["llm_worker"](engine, SamplingParams(bad_words=list(PLACEHOLDERS), max_tokens=4))
    assert received[0].bad_words == list(PLACEHOLDERS) and not received[0].logit_bias


# --- the ban's share of the distribution does not shrink the gradient (with sampling_parity) ----------------------


def grad_norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


@pytest.mark.parametrize("policy", ["realistic", "loving"])
def test_training_under_the_ban_keeps_its_gradient(
    policy: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_fix_off: Any
) -> None:
    """The ban takes the placeholders' share out of every token's distribution, and vLLM reports log-probs of the
    rest. With sampling_parity the batch trains with the gradient it has once that share is accounted for (at
    identical weights the weight that compares like with like is 1); upstream every row is weighted by the product
    of its kept shares: ~0.97 for a realistic policy at 32 tokens, ~0 for one that loves its placeholders."""
    import trl.generation.vllm_generation as vllm_generation
    from datasets import Dataset

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM

    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    prompt = [{"role": "user", "content": "describe"}]
    trainer = loving_trainer(
        request.getfixturevalue(f"{policy}_model_dir"),
        tmp_path,
        "grpo",
        use_vllm=True,
        vllm_mode="colocate",
        num_generations=4,
        max_completion_length=32,
        dataset=Dataset.from_dict({"prompt": [prompt]}),
    )
    trainer.reward_funcs = [scores_the_bad_row_highest]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    banned = placeholder_ids(trainer.processing_class)

    torch.manual_seed(0)  # vLLM samples from torch's generator: the same rollout with the fix and without it
    batch = trainer._generate_and_score_completions([{"prompt": prompt}] * 4)
    counted = metrics.drain(trainer)
    kept = counted[counters.SAMPLING_KEPT_MASS.name] / counted[counters.SAMPLING_KEPT_MASS.name + "/count"]
    assert not banned & set(batch["completion_ids"].flatten().tolist())  # the ban held
    _, grads = loss_and_grads(trainer, batch)
    accounted = {**batch, "importance_sampling_ratio": torch.ones_like(batch["importance_sampling_ratio"])}
    _, expected = loss_and_grads(trainer, accounted)
    assert grad_norm(expected) > 0
    ratio = batch["importance_sampling_ratio"]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5), ratio
    tolerance = 1e-4 * max(g.abs().max().item() for g in expected.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=tolerance, msg=name)

    one_fix_off("sampling_parity")
    torch.manual_seed(0)
    upstream = trainer._generate_and_score_completions([{"prompt": prompt}] * 4)
    assert torch.equal(upstream["completion_ids"], batch["completion_ids"])  # the same rollout
    _, upstream_grads = loss_and_grads(trainer, upstream)
    shrink = grad_norm(upstream_grads) / grad_norm(expected)
    weights = upstream["importance_sampling_ratio"].flatten()
    if policy == "realistic":  # about 1e-3 of the mass banned per token
        assert 0.99 < kept < 0.9999, kept
        assert 0.9 < float(weights.mean()) < 0.999 and shrink < 0.999, (weights, shrink)
    else:  # about half of it
        assert kept < 0.8, kept
        assert float(weights.max()) < 1e-3 and shrink < 1e-3, (weights, shrink)


def test_a_users_own_none_reward_is_still_warned_about(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    with_setting: Callable[[str, str], None],
    caplog: Any,
) -> None:
    """The guard hides TRL's "All reward functions returned None" warning only where it names a row the guard
    masked (row 0 here); the user's own None (row 2) is still named, once."""
    trainer = one_bad_row_trainer(tiny_model_dir, tmp_path, monkeypatch, "grpo", with_setting)

    def leaves_row_2_unscored(completions: list[Any], **_: Any) -> list[float | None]:
        return [10.0, 0.0, None, 2.0]

    trainer.reward_funcs = [leaves_row_2_unscored]
    trl_logger = logging.getLogger("trl.trainer.grpo_trainer")  # TRL's, whatever an earlier test did to its level
    trl_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING"), caplog.at_level("WARNING", logger=trl_logger.name):
            trainer._generate_and_score_completions([{"prompt": [{"role": "user", "content": "describe"}]}] * 4)
    finally:
        trl_logger.removeHandler(caplog.handler)
    records = {id(r): r for r in caplog.records}.values()  # the handler may see a record twice (propagation)
    named = [r.getMessage() for r in records if "All reward functions returned None" in r.getMessage()]
    assert len(named) == 1 and "for row 2 " in named[0], named
