"""A behavioural stand-in for ``vllm.LLM`` in colocate mode, for CPU machines where no vLLM engine can run.

It models what the reload_skip fix is about, as measured on an H200 with vLLM 0.25.1: level-2 sleep discards the
weights (they read as zeros after waking), ``collective_rpc("reload_weights")`` restores the checkpoint from disk,
``load_weights`` stores pushed tensors, and every ``generate`` records the weights it ran on. Its caches follow vLLM
0.25.1 (``_EngineCaches``): what each one keeps across requests, and what resets it. A prompt with
``multi_modal_data`` goes through vLLM's own multimodal processor (``vllm_processor``), so the prompt ids it reports
and samples from are the ones the real engine would use. Its public methods keep
the real ``vllm.LLM`` signatures (checked by the tests wherever vLLM imports) so it cannot drift.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return weights


@dataclass
class Logprob:
    logprob: float
    rank: int = 1


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


BLOCK_SIZE = 16  # vLLM's default KV block: only full blocks enter the prefix cache


class _EngineCaches:
    """vLLM 0.25.1's caches that outlive a request, each entry tagged with the weights version it was computed on.

    - encoder cache: vision embeddings by image hash, shared between requests (``EncoderCacheManager``): weight-
      dependent;
    - multimodal cache: the processor's outputs by image hash (renderer and engine-core caches): weight-independent;
    - prefix cache: KV blocks by token prefix and the images in it (``BlockPool``): weight-dependent.

    Resets, as in vLLM: a sleep of level >= 1 clears all three (``EngineCore.sleep`` -> ``pause_scheduler(
    clear_cache=True)`` -> ``_reset_caches``; ``LLMEngine.sleep`` clears the renderer's); ``reload_weights`` the
    encoder and multimodal caches (``GPUModelRunner.reload_weights``); ``LLM.reset_prefix_cache``,
    ``LLM.reset_mm_cache`` and ``LLMEngine.reset_encoder_cache`` one each.
    """

    def __init__(self) -> None:
        self.encoder: dict[str, int] = {}
        self.multimodal: set[str] = set()
        self.prefix: dict[tuple[Any, ...], int] = {}
        self.stale_reads: list[str] = []  # every reuse of an entry computed on other weights than the current ones

    def clear(self) -> None:
        self.encoder.clear()
        self.multimodal.clear()
        self.prefix.clear()

    def read(self, ids: list[int], images: list[Any], version: int) -> None:
        """One request: reuse what is cached (noting stale entries), then cache what it computed."""
        hashes = [_image_hash(image) for image in images]
        for digest in hashes:
            self.multimodal.add(digest)
            cached = self.encoder.setdefault(digest, version)
            if cached != version:
                self.stale_reads.append(f"encoder output of image {digest[:8]} from weights v{cached}, now v{version}")
        for end in range(BLOCK_SIZE, len(ids) + 1, BLOCK_SIZE):
            cached = self.prefix.setdefault((*hashes, *ids[:end]), version)
            if cached != version:
                self.stale_reads.append(f"prefix KV of {end} tokens from weights v{cached}, now v{version}")


def _image_hash(image: Any) -> str:
    """vLLM hashes an image's content (``MultiModalHasher``); this hashes its pixels, size and mode."""
    tobytes = getattr(image, "tobytes", None)
    content = tobytes() if tobytes is not None else repr(image).encode()
    shape = repr((getattr(image, "size", None), getattr(image, "mode", None))).encode()
    return hashlib.sha256(content + shape).hexdigest()


def _prompt_images(prompt: Any) -> list[Any]:
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    images = (data or {}).get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, list | tuple) else [images]


class _WeightLoader:
    """``llm_engine.model_executor.driver_worker.model_runner.model``: where TRL pushes tensors."""

    def __init__(self, engine: StandInLLM) -> None:
        self._engine = engine

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if not self._engine.weights_awake:
                raise RuntimeError(f"load_weights({name}) while the weights are asleep: wake_up first")
            self._engine.weights[name] = tensor.detach().to("cpu", copy=True)
            self._engine.weights_version += 1
            self._engine.tensor_pushes += 1
            loaded.add(name)
        return loaded


class _EngineLoop(SimpleNamespace):
    """``llm.llm_engine``, with the step loop of vLLM 0.25.1's ``LLM._run_engine``: ``step()`` is one scheduler
    iteration (one more token for every running request) and returns the requests that finished in it, so whoever
    watches ``step`` sees a rollout's progress as with the real engine."""

    steps = 0
    _running: list[tuple[RequestOutput, int]] = []  # request, tokens it still has to produce

    def admit(self, requests: list[RequestOutput]) -> None:
        longest = (max((len(c.token_ids) for c in r.outputs), default=0) for r in requests)
        self._running = [*self._running, *((r, max(1, n)) for r, n in zip(requests, longest, strict=True))]

    def reset_encoder_cache(self) -> None:
        """``LLMEngine.reset_encoder_cache``: the one public reset of the encoder cache in vLLM 0.25.1."""
        self.caches.encoder.clear()

    def has_unfinished_requests(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        advanced = [(request, left - 1) for request, left in self._running]
        self._running = [(request, left) for request, left in advanced if left > 0]
        return [request for request, left in advanced if left <= 0]


class StandInLLM:
    """Colocated engine: sleep levels, reload from disk, pushed weights, and a record of each rollout's weights.

    ``favourite_token_ids``: tokens this engine samples second in every completion unless the request bans them, as a
    policy that loves its vision placeholders does; ``bad_words`` are honoured as vLLM does for single tokens.
    """

    favourite_token_ids: tuple[int, ...] = ()

    def __init__(self, model: str, *, enable_sleep_mode: bool = False, **kwargs: Any) -> None:
        self.init_kwargs: dict[str, Any] = {"model": model, "enable_sleep_mode": enable_sleep_mode, **kwargs}
        self.checkpoint = read_checkpoint(model)
        # a random model samples close to uniformly: reporting that log-probability keeps TRL's importance-sampling
        # ratio near 1, as with a real engine (a made-up value would mask every sequence and zero the gradients)
        vocab_matrices = ("lm_head.weight", "embed_tokens.weight")
        vocab = next(t.shape[0] for n, t in self.checkpoint.items() if n.endswith(vocab_matrices))
        self.sampling_logprob = -math.log(vocab)
        self.weights = {name: tensor.clone() for name, tensor in self.checkpoint.items()}
        self.weights_awake = True
        self.kv_cache_awake = True
        self.disk_reloads = 0
        self.tensor_pushes = 0
        self.sleeps: list[int] = []
        self.rollouts: list[dict[str, torch.Tensor]] = []
        self._tokenizer: Any = None  # for bad_words, loaded on first use
        # "vllm" once a multimodal prompt went through vLLM's real processor, else why it could not
        self.mm_processing: str | None = None
        self.prompts_seen: list[list[int]] = []  # the prompt ids each request was sampled from, as vLLM reports them
        self.weights_version = 0  # changes with every change of the weights: what each cache entry is tagged with
        self.caches = _EngineCaches()
        self.llm_engine = _EngineLoop(
            model_config=SimpleNamespace(max_model_len=kwargs.get("max_model_len") or 4096),  # read by TRL's tool loop
            model_executor=SimpleNamespace(
                driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=_WeightLoader(self)))
            ),
        )
        self.llm_engine.caches = self.caches
        config = Path(model) / "config.json"
        if config.is_file() and "vision_config" in json.loads(config.read_text()):
            self._build_mm_processor()

    def _build_mm_processor(self) -> None:
        """vLLM builds its multimodal processor with the engine, not at the first generate (where the rollout
        watchdog would count its ~10-50 s of imports and model inspection as a rollout without progress)."""
        from .vllm_processor import VllmProcessorUnavailable, processor_for

        try:
            processor_for(self.init_kwargs["model"], self.init_kwargs.get("mm_processor_kwargs"))
        except VllmProcessorUnavailable as error:
            self.mm_processing = str(error)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.init_kwargs["enable_sleep_mode"]:
            raise RuntimeError("sleep() needs enable_sleep_mode=True")
        self.sleeps.append(level)
        if level >= 1:  # vLLM clears its caches on any sleep that frees memory
            self.caches.clear()
        if level >= 2:  # level 2 frees the weights: what is read after waking up is garbage (zeros on an H200)
            self.weights = {name: torch.zeros_like(tensor) for name, tensor in self.weights.items()}
            self.weights_version += 1
        self.weights_awake = False
        self.kv_cache_awake = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        self.weights_awake = self.weights_awake or "weights" in tags
        self.kv_cache_awake = self.kv_cache_awake or "kv_cache" in tags

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        if method == "reload_weights":
            self.weights = {name: tensor.clone() for name, tensor in read_checkpoint(self.init_kwargs["model"]).items()}
            self.weights_version += 1
            self.caches.encoder.clear()
            self.caches.multimodal.clear()
            self.disk_reloads += 1
            return [None]
        raise NotImplementedError(f"stand-in engine has no worker method {method!r}")

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.caches.prefix.clear()
        return True

    def reset_mm_cache(self) -> None:
        self.caches.multimodal.clear()

    def generate(
        self,
        prompts: Any,
        sampling_params: Any = None,
        *,
        use_tqdm: Any = True,
        lora_request: Any = None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        if not (self.weights_awake and self.kv_cache_awake):
            raise RuntimeError("generate() on a sleeping engine")
        self.rollouts.append({name: tensor.clone() for name, tensor in self.weights.items()})
        banned = self.banned_token_ids(sampling_params)
        favourites = [t for t in self.favourite_token_ids if t not in banned]
        n = getattr(sampling_params, "n", 1) or 1
        max_tokens = getattr(sampling_params, "max_tokens", 4) or 4
        want_logprobs = getattr(sampling_params, "logprobs", None) is not None
        outputs = []
        for row, prompt in enumerate(prompts if isinstance(prompts, list) else [prompts]):
            ids = self.engine_prompt_ids(prompt)
            self.prompts_seen.append(ids)
            self.caches.read(ids, _prompt_images(prompt), self.weights_version)
            completions = []
            for k in range(n):
                # lengths differ between the copies of one prompt, so a group's rewards differ and training moves
                length = max(1, max_tokens - (row + k) % 3)
                tokens = [32 + (sum(ids) + 7 * k + i) % 90 for i in range(length)]
                if favourites:
                    tokens[min(1, length - 1)] = favourites[(row + k) % len(favourites)]
                logprobs = [{t: Logprob(self.sampling_logprob)} for t in tokens] if want_logprobs else None
                completions.append(CompletionOutput(tokens, logprobs))
            outputs.append(RequestOutput(ids, completions))
        self.llm_engine.admit(outputs)  # as LLM._run_engine: step until every request has finished
        finished: set[int] = set()
        while self.llm_engine.has_unfinished_requests():
            finished.update(id(request) for request in self.llm_engine.step())
        return [request for request in outputs if id(request) in finished]

    def engine_prompt_ids(self, prompt: Any) -> list[int]:
        """The ids the engine samples from: a multimodal prompt is processed by vLLM's own processor, as in vLLM."""
        ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else list(prompt)
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not mm_data:
            return ids
        from .vllm_processor import VllmProcessorUnavailable, engine_prompt_ids

        try:
            processed = engine_prompt_ids(
                self.init_kwargs["model"], ids, mm_data, self.init_kwargs.get("mm_processor_kwargs")
            )
        except VllmProcessorUnavailable as error:
            if self.mm_processing is None:
                warnings.warn(f"engine stand-in reports multimodal prompts unprocessed: {error}", stacklevel=2)
            self.mm_processing = str(error)
            return ids
        self.mm_processing = "vllm"
        return processed

    def banned_token_ids(self, sampling_params: Any) -> set[int]:
        """Never sampled, as in vLLM: a ``logit_bias`` of -inf (added to the logits), and a ``bad_words`` word that
        encodes to one token."""
        biased = {
            int(t) for t, bias in (getattr(sampling_params, "logit_bias", None) or {}).items() if bias == -math.inf
        }
        words = getattr(sampling_params, "bad_words", None) or []
        if not words:
            return biased
        if self._tokenizer is None:  # loaded once per engine, as vLLM does, not once per generate
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.init_kwargs["model"])
        encoded = [self._tokenizer.encode(word, add_special_tokens=False) for word in words]
        return biased | {ids[0] for ids in encoded if len(ids) == 1}


def engine_weights_match(snapshot: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``reference`` equals the engine's (the engine may hold more names, never different values)."""
    return all(name in snapshot and torch.equal(snapshot[name], tensor.cpu()) for name, tensor in reference.items())


def trainer_weights(model: Any) -> dict[str, torch.Tensor]:
    """The trainer's parameters under the names TRL pushes them with."""
    return {
        name.replace("_checkpoint_wrapped_module.", ""): p.detach().cpu().clone()
        for name, p in model.named_parameters()
    }


class StandInSamplingParams:
    """Only where vLLM is not installed: holds the sampling arguments TRL passes."""

    def __init__(self, **kwargs: Any) -> None:
        self.n = 1
        self.max_tokens = 16
        self.logprobs = None
        self.__dict__.update(kwargs)
