"""A behavioural stand-in for ``vllm.LLM`` in colocate mode, for CPU machines where no vLLM engine can run.

It models what the reload_skip fix is about, as measured on an H200 with vLLM 0.25.1: level-2 sleep discards the
weights (they read as zeros after waking), ``collective_rpc("reload_weights")`` restores the checkpoint from disk,
``load_weights`` stores pushed tensors, and every ``generate`` records the weights it ran on. Its caches follow vLLM
0.25.1 (``_EngineCaches``): what each one keeps across requests, and what resets it. A prompt with
``multi_modal_data`` goes through vLLM's own multimodal processor (``vllm_processor``), so the prompt ids it reports
and samples from are the ones the real engine would use. It decodes for real, one token per engine step: the
checkpoint's transformers model on the weights the engine holds (``served_model``) gives the logits, and vLLM's own
``Sampler`` samples them with the request's ``SamplingParams`` (``vllm_sampler``) and returns the processed
log-probabilities a real engine built by TRL returns. Its public methods keep the real ``vllm.LLM`` signatures
(checked by the tests wherever vLLM imports) so it cannot drift.
"""

from __future__ import annotations

import hashlib
import json
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


class _Countdown:
    """A request whose tokens are already decided (a test's scripted output): it finishes after as many steps."""

    def __init__(self, request: RequestOutput) -> None:
        self.request = request
        self.left = max(1, max((len(c.token_ids) for c in request.outputs), default=0))

    def step(self) -> list[RequestOutput]:
        self.left -= 1
        return [self.request] if self.left <= 0 else []

    @property
    def running(self) -> bool:
        return self.left > 0


class _EngineLoop(SimpleNamespace):
    """``llm.llm_engine``, with the step loop of vLLM 0.25.1's ``LLM._run_engine``: ``step()`` is one scheduler
    iteration (one more token for every running request) and returns the requests that finished in it, so whoever
    watches ``step`` sees a rollout's progress as with the real engine."""

    steps = 0
    _running: list[Any] = []  # what is being decoded: a _Decoding, or a _Countdown of a scripted request

    def admit(self, requests: list[RequestOutput]) -> None:
        """Requests whose tokens are already decided, finishing after as many steps as their longest completion."""
        self.run([_Countdown(request) for request in requests])

    def run(self, work: list[Any]) -> None:
        self._running = [*self._running, *work]

    def reset_encoder_cache(self) -> None:
        """``LLMEngine.reset_encoder_cache``: the one public reset of the encoder cache in vLLM 0.25.1."""
        self.caches.encoder.clear()

    def has_unfinished_requests(self) -> bool:
        return any(work.running for work in self._running)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        finished = [request for work in self._running for request in work.step()]
        self._running = [work for work in self._running if work.running]
        return finished


@dataclass
class _Sequence:
    """One completion being decoded (vLLM: one child request of a prompt's ``n``)."""

    prompt: RequestOutput
    completion: CompletionOutput
    vision: dict[str, torch.Tensor]
    request: Any  # vllm_sampler.Request
    script: list[int] | None  # tokens a test decided in advance (their processed log-probs are still vLLM's)
    done: bool = False


class _Decoding:
    """The requests of one ``generate``: every engine step computes each running sequence's next-token logits with
    the served model on the engine's current weights and samples them all with vLLM's own ``Sampler``."""

    def __init__(self, engine: StandInLLM, sequences: list[_Sequence], batch: Any) -> None:
        self.engine = engine
        self.sequences = sequences
        self.batch = batch
        self._reported: set[int] = set()

    @property
    def running(self) -> bool:
        return any(not sequence.done for sequence in self.sequences)

    def step(self) -> list[RequestOutput]:
        served = self.engine.served
        served.use(self.engine.weights, (id(self.engine), self.engine.weights_version))
        live = [sequence for sequence in self.sequences if not sequence.done]
        logits = {
            s.request.request_id: served.next_logits(s.request.prompt_token_ids, s.request.output_token_ids, s.vision)
            for s in live
        }
        scripted = {s.request.request_id: s.script[len(s.request.output_token_ids)] for s in live if s.script}
        sampled = self.batch.sample(logits, scripted)
        finished = []
        for sequence in live:
            token = sampled[sequence.request.request_id]
            self.batch.append(sequence.request, token.token_id)
            sequence.completion.token_ids.append(token.token_id)
            if sequence.completion.logprobs is not None:
                sequence.completion.logprobs.append({token.token_id: Logprob(token.logprob, token.rank)})
            if self._finished(sequence, token.token_id):
                sequence.done = True
                finished.append(sequence.request)
        self.batch.finish(finished)
        return self._newly_finished()

    def _finished(self, sequence: _Sequence, token_id: int) -> bool:
        """vLLM's stop checks: max_tokens, then a stop token (EOS unless ignore_eos) once min_tokens are out."""
        params = sequence.request.params
        produced = len(sequence.request.output_token_ids)
        if sequence.script is not None and produced >= len(sequence.script):
            return True
        max_tokens = getattr(params, "max_tokens", None)
        if produced >= (max_tokens if max_tokens is not None else 16):
            return True
        stops = set(getattr(params, "stop_token_ids", None) or ())
        if not getattr(params, "ignore_eos", False):
            stops |= self.engine.served.eos_token_ids | self.engine.eos_token_ids
        return token_id in stops and produced >= (getattr(params, "min_tokens", 0) or 0)

    def _newly_finished(self) -> list[RequestOutput]:
        finished = []
        for sequence in self.sequences:
            prompt = sequence.prompt
            if id(prompt) in self._reported:
                continue
            if all(s.done for s in self.sequences if s.prompt is prompt):
                self._reported.add(id(prompt))
                finished.append(prompt)
        return finished


class StandInLLM:
    """Colocated engine: sleep levels, reload from disk, pushed weights, and a record of each rollout's weights.

    It decodes for real: the served model (the checkpoint's transformers class, ``served_model``) computes the logits
    from the weights the engine holds, and vLLM's own ``Sampler`` (``vllm_sampler``) samples them with the request's
    ``SamplingParams`` and returns the processed log-probabilities TRL asks for (``logprobs_mode``). ``script``: a
    test may decide a request's tokens in advance (a tool call); vLLM's processed log-probabilities of those tokens are
    reported, as for tokens the engine sampled.
    """

    def __init__(self, model: str, *, enable_sleep_mode: bool = False, **kwargs: Any) -> None:
        from .served_model import served_model

        self.init_kwargs: dict[str, Any] = {"model": model, "enable_sleep_mode": enable_sleep_mode, **kwargs}
        self.served = served_model(str(model))
        # the checkpoint as the engine loads it: under the names TRL pushes (the model's parameter names)
        self.checkpoint = {name: tensor.clone() for name, tensor in self.served.checkpoint.items()}
        self.weights = {name: tensor.clone() for name, tensor in self.checkpoint.items()}
        self.weights_awake = True
        self.kv_cache_awake = True
        self.disk_reloads = 0
        self.tensor_pushes = 0
        self.sleeps: list[int] = []
        self.rollouts: list[dict[str, torch.Tensor]] = []
        # "vllm" once a multimodal prompt went through vLLM's real processor, else why it could not
        self.mm_processing: str | None = None
        self.prompts_seen: list[list[int]] = []  # the prompt ids each request was sampled from, as vLLM reports them
        self.weights_version = 0  # changes with every change of the weights: what each cache entry is tagged with
        self.caches = _EngineCaches()
        max_model_len = kwargs.get("max_model_len") or 4096
        self.llm_engine = _EngineLoop(
            model_config=SimpleNamespace(  # read by TRL's tool loop, and by fixes that check the logprobs mode
                max_model_len=max_model_len, logprobs_mode=kwargs.get("logprobs_mode", "raw_logprobs")
            ),
            model_executor=SimpleNamespace(
                driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=_WeightLoader(self)))
            ),
        )
        self.llm_engine.caches = self.caches
        self.llm_engine.vllm_config = built_config(kwargs)
        self._sampler: Any = None
        self.sampling: str | None = None  # "vllm" once vLLM's Sampler sampled, else why it could not
        config = Path(model) / "config.json"
        if config.is_file() and "vision_config" in json.loads(config.read_text()):
            self._build_mm_processor()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's end-of-sequence token, which vLLM stops at besides the generation config's."""
        tokenizer = self._tokenizer()
        eos = getattr(tokenizer, "eos_token_id", None)
        return frozenset([eos]) if isinstance(eos, int) else frozenset()

    def _tokenizer(self) -> Any:
        from .vllm_sampler import engine_tokenizer

        try:
            return engine_tokenizer(str(self.init_kwargs["model"]))
        except ImportError:  # no vLLM: the checkpoint's own tokenizer (the fallback sampler reads no bad words)
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.init_kwargs["model"])

    def script(self, prompt_ids: list[int], row: int, sample: int) -> list[int] | None:
        """Tokens decided in advance for a request (None: sample them); a test's subclass overrides this."""
        return None

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
            self.weights = {name: tensor.clone() for name, tensor in self.checkpoint.items()}
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
        from .vllm_sampler import Request, sampler_for

        if not (self.weights_awake and self.kv_cache_awake):
            raise RuntimeError("generate() on a sleeping engine")
        self.rollouts.append({name: tensor.clone() for name, tensor in self.weights.items()})
        params = sampling_params if sampling_params is not None else _default_sampling_params()
        n = getattr(params, "n", 1) or 1
        want_logprobs = getattr(params, "logprobs", None) is not None
        outputs: list[RequestOutput] = []
        sequences: list[_Sequence] = []
        for row, prompt in enumerate(prompts if isinstance(prompts, list) else [prompts]):
            ids = self.engine_prompt_ids(prompt)
            images = _prompt_images(prompt)
            self.prompts_seen.append(ids)
            self.caches.read(ids, images, self.weights_version)
            vision = self.served.vision_inputs(ids, images)
            output = RequestOutput(ids)
            for sample in range(n):
                completion = CompletionOutput([], [] if want_logprobs else None)
                output.outputs.append(completion)
                request = Request(ids, params.clone() if hasattr(params, "clone") else params)
                sequences.append(_Sequence(output, completion, vision, request, self.script(ids, row, sample)))
            outputs.append(output)
        if self._sampler is None:
            self._sampler = sampler_for(self.served.vocab_size, self.llm_engine.model_config.max_model_len)
            self.sampling = getattr(self._sampler, "reason", "vllm")
        batch = self._sampler.new_batch([s.request for s in sequences], self._tokenizer())
        self.llm_engine.run([_Decoding(self, sequences, batch)])  # as LLM._run_engine: step until all finished
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


def built_config(kwargs: dict[str, Any]) -> Any:
    """``llm.llm_engine.vllm_config`` as a GPU engine resolves the arguments (what the engine fixes read back):
    vLLM's own ``CompilationConfig`` of the ``compilation_config`` given; no ``cudagraph_mode`` is vLLM's GPU default,
    ``FULL_AND_PIECEWISE`` (measured on an H200); ``enforce_eager=True`` makes it ``NONE`` (``VllmConfig.__post_init__``
    in vLLM 0.25.1); ``gdn_prefill_backend`` goes to ``additional_config``, ``moe_backend`` to ``kernel_config`` as
    ``KernelConfig`` normalises it (``EngineArgs.create_engine_config``). On the CPU vLLM's own ``VllmConfig`` would
    resolve every mode to NONE (no CUDA graphs there), hence this model."""
    from types import SimpleNamespace

    given = kwargs.get("compilation_config")
    mode: Any = None
    try:
        from vllm.config import CompilationConfig, CUDAGraphMode

        config = CompilationConfig(**given) if isinstance(given, dict) else given
        mode = getattr(config, "cudagraph_mode", None)
        if mode is None or kwargs.get("enforce_eager"):
            name = "NONE" if kwargs.get("enforce_eager") else "FULL_AND_PIECEWISE"
            mode = CUDAGraphMode.__members__.get(name) or SimpleNamespace(name=name)  # a vLLM without the member
    except ImportError:
        mode = SimpleNamespace(name="NONE" if kwargs.get("enforce_eager") else "FULL_AND_PIECEWISE")
    backend = kwargs.get("gdn_prefill_backend")
    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=mode),
        kernel_config=SimpleNamespace(moe_backend=str(kwargs.get("moe_backend") or "auto").lower().replace("-", "_")),
        model_config=SimpleNamespace(enforce_eager=bool(kwargs.get("enforce_eager"))),
        additional_config={"gdn_prefill_backend": backend} if backend else {},
    )


def _default_sampling_params() -> Any:
    try:
        from vllm import SamplingParams
    except ImportError:
        return StandInSamplingParams()
    return SamplingParams()


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
