"""vLLM's own sampling on the CPU: the token and the log-probability a real engine returns for a request's logits.

One engine step of vLLM 0.25.1 samples every running request from its logits with ``vllm.v1.sample.sampler.Sampler``
and the request state of ``vllm.v1.worker.gpu_input_batch.InputBatch``: the request's ``SamplingParams`` become a
``SamplingMetadata`` (temperature, top-k, top-p, the ``bad_words`` token ids, and the built-in logits processors:
``logit_bias``, ``min_p``, ``min_tokens``), and with ``logprobs_mode="processed_logprobs"`` (what TRL asks for) the
returned log-probability is taken after all of them, renormalised over the tokens that survive. This module runs
exactly that code on the CPU, so the engine stand-in reports what the real engine reports.

vLLM's top-k/top-p rule depends on the step: on CUDA, ``apply_top_k_top_p`` sends a step of 8 or more requests
through its Triton kernel (``apply_top_k_top_p_triton``) and fewer through its sort path. Without a GPU vLLM has no
Triton, so while a step is sampled (``cuda_dispatch``) its ``topk_topp_sampler`` module sees ``HAS_TRITON`` true,
that kernel run by Triton's interpreter with the CUDA tiles (``sampling_parity.kernel_copy``) and a platform that is
not a CPU: vLLM's own dispatch then picks the path the GPU engine picks, and the plugin's engine wrapper, when on,
reads the same globals. They are put back after every step. Where the installed vLLM's kernel is not one the copy
was proven on, the module is left alone (its sort path at every step) and ``dispatch_note`` says why. vLLM 0.31 sends
every step to the kernel where it has Triton, and the copy dispatches inside it as on CUDA (a step of at most 64
requests with top-p alone: the split-row pipeline); its sampler registers the kernels' warm-up compilations when it is
built on a GPU, which the stand-in skips (``register_top_k_top_p_warmups``: nothing is compiled in the interpreter).

On a machine without a CUDA driver, vLLM's platform is ``UnspecifiedPlatform``, which claims pinned host memory; vLLM
reads that once, at import, into ``PIN_MEMORY`` globals. Pinning needs a driver, so ``_unpin`` sets those globals to
False (a GPU engine pins; nothing else about sampling depends on it).
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

BLOCK_SIZE = 16
_request_ids = itertools.count()


def _unpin() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "PIN_MEMORY", None) is True:
            setattr(module, "PIN_MEMORY", False)  # noqa: B010 - a module global vLLM read at import


@functools.cache
def engine_tokenizer(model_dir: str) -> Any:
    """vLLM's tokenizer for the served model (``max_token_id`` and all), as its input processor uses it. Reading the
    model's config registers vLLM's config classes with transformers; they are taken out again (``vllm_processor``)."""
    from vllm.tokenizers.registry import get_tokenizer

    from .vllm_processor import transformers_config_classes_kept

    with transformers_config_classes_kept():
        return get_tokenizer(model_dir)


_SAMPLER_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"
_DISPATCH_GLOBALS = ("HAS_TRITON", "apply_top_k_top_p_triton", "current_platform", "register_top_k_top_p_warmups")


def _no_warmups() -> None:
    """vLLM 0.31's ``register_top_k_top_p_warmups`` in the stand-in: the interpreter compiles nothing."""


class _NotCpu:
    """vLLM's platform as its sampler module sees it on a GPU: not a CPU (everything else is the real platform's)."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def is_cpu(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


def dispatch_note() -> str | None:
    """Why the stand-in cannot take the GPU engine's top-k/top-p paths here (vLLM's sort path at every step), or
    None where it takes them."""
    from ..patches.sampling_parity import kernel_copy

    return kernel_copy.why_no_copy()


@contextmanager
def cuda_dispatch() -> Iterator[None]:
    """While it is open, vLLM's sampler module dispatches as on CUDA with Triton (see the module docstring)."""
    import importlib

    from ..patches.sampling_parity import kernel_copy

    module = importlib.import_module(_SAMPLER_MODULE)
    scope = vars(module)
    if dispatch_note() is not None or (scope["HAS_TRITON"] and not scope["current_platform"].is_cpu()):
        yield  # no proven kernel copy, or a real GPU engine's module: nothing to stand in for
        return
    saved = {name: scope[name] for name in _DISPATCH_GLOBALS if name in scope}
    scope["HAS_TRITON"] = True
    scope["apply_top_k_top_p_triton"] = kernel_copy.interpreted_top_k_top_p(kernel_copy.CUDA_TILES)
    if saved["current_platform"].is_cpu():
        scope["current_platform"] = _NotCpu(saved["current_platform"])
    if "register_top_k_top_p_warmups" in saved:
        scope["register_top_k_top_p_warmups"] = _no_warmups
    try:
        yield
    finally:
        for name in _DISPATCH_GLOBALS:
            if name in saved:
                scope[name] = saved[name]
            else:
                scope.pop(name, None)


@dataclass
class SampledToken:
    token_id: int
    logprob: float  # processed: after every logits processor, top-k/top-p and temperature, renormalised
    rank: int  # 1-based rank of the sampled token among the processed log-probs
    kept: int | None = None  # tokens the processed distribution keeps (finite log-probs); None: not vLLM's sampler


@dataclass
class Request:
    """One sequence being decoded: the prompt, what it sampled so far (vLLM reads it for bad words and penalties)."""

    prompt_token_ids: list[int]
    params: Any  # vllm.SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    request_id: str = field(default_factory=lambda: str(next(_request_ids)))


class VllmSampler:
    """vLLM's ``Sampler`` over an ``InputBatch`` of the running requests, one call per engine step."""

    def __init__(self, vocab_size: int, max_model_len: int, max_requests: int = 256) -> None:
        _unpin()
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors
        from vllm.v1.sample.sampler import Sampler

        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_requests = max_requests
        # the built-in processors read only the scheduler's request capacity from the engine config
        config: Any = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=max_requests))
        self._processors = lambda: LogitsProcessors(
            processor(config, torch.device("cpu"), False) for processor in BUILTIN_LOGITS_PROCESSORS
        )
        with cuda_dispatch():  # the top-k/top-p sampler picks its forward by platform: the CUDA one, forward_native
            self.sampler = Sampler(logprobs_mode="processed_logprobs")

    def new_batch(self, requests: list[Request], tokenizer: Any) -> _Batch:
        """The requests of one ``generate`` as vLLM's persistent batch holds them (finished ones leave it)."""
        from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

        if len(requests) > self.max_requests:
            raise ValueError(f"{len(requests)} requests for a stand-in engine of {self.max_requests}")
        batch = InputBatch(
            max_num_reqs=self.max_requests,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_model_len,
            device=torch.device("cpu"),
            vocab_size=self.vocab_size,
            block_sizes=[BLOCK_SIZE],
            kernel_block_sizes=[BLOCK_SIZE],
            max_num_blocks_per_req=[self.max_model_len // BLOCK_SIZE + 1],
            logitsprocs=self._processors(),
        )
        for request in requests:
            # the engine's own copy: every log-prob of the processed distribution (not only the request's top ones),
            # so that a scripted token's is at hand too; bad words become token ids, as vLLM's input processor does
            params = request.params.clone()
            params.logprobs = -1
            params.update_from_tokenizer(tokenizer)
            generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            batch.add_request(
                CachedRequestState(
                    req_id=request.request_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    mm_features=[],
                    sampling_params=params,
                    pooling_params=None,
                    generator=generator,
                    block_ids=([],),
                    num_computed_tokens=0,
                    output_token_ids=request.output_token_ids,
                )
            )
        return _Batch(batch, self.sampler)


class _Batch:
    def __init__(self, batch: Any, sampler: Any) -> None:
        self._batch = batch
        self._sampler = sampler

    def sample(self, logits: dict[str, torch.Tensor], scripted: dict[str, int]) -> dict[str, SampledToken]:
        """One step: ``logits`` holds one [vocab] row per running request id (finished requests must be removed);
        ``scripted`` names requests whose token was decided in advance: theirs is reported with vLLM's processed
        log-probability of that token instead of the one sampled."""
        batch = self._batch
        batch.refresh_metadata()
        order = batch.req_ids
        rows = torch.stack([logits[request_id].to(torch.float32) for request_id in order])
        with cuda_dispatch():  # every running request in one call, as one engine step: vLLM picks the path by count
            output = self._sampler(rows, batch.sampling_metadata)
        tensors = output.logprobs_tensors  # every token: column 0 the sampled one, then all by rank
        result = {}
        kept = (tensors.logprobs[:, 1:] > float("-inf")).sum(dim=1).tolist()
        for row, request_id in enumerate(order):
            if request_id in scripted:
                token = scripted[request_id]
                column = 1 + int((tensors.logprob_token_ids[row, 1:] == token).nonzero()[0, 0])
                logprob = float(tensors.logprobs[row, column])
                rank = int((tensors.logprobs[row, 1:] >= logprob).sum())
            else:
                token = int(output.sampled_token_ids[row, 0])
                logprob = float(tensors.logprobs[row, 0])
                rank = int(tensors.selected_token_ranks[row])
            result[request_id] = SampledToken(token, logprob, rank, kept[row])
        return result

    def append(self, request: Request, token_id: int) -> None:
        """The sampled token joins the request's output (vLLM's bad words and penalties read it next step)."""
        request.output_token_ids.append(token_id)
        index = self._batch.req_id_to_index[request.request_id]
        self._batch.num_tokens_no_spec[index] += 1

    def finish(self, requests: list[Request]) -> None:
        """The requests that finished in this step leave the batch together, as the model runner removes them."""
        if not requests:
            return
        for request in requests:
            self._batch.remove_request(request.request_id)
        self._batch.condense()


class TorchSampler:
    """Where vLLM is not installed (a self-test on a trainer-only machine): the model's own distribution at the
    request's temperature, no other setting, raw log-probabilities. Not what vLLM reports; the engine says so."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def new_batch(self, requests: list[Request], tokenizer: Any) -> _TorchBatch:
        return _TorchBatch()


class _TorchBatch:
    def sample(self, logits: dict[str, torch.Tensor], scripted: dict[str, int]) -> dict[str, SampledToken]:
        result = {}
        for request_id, row in logits.items():
            logprobs = torch.log_softmax(row.to(torch.float32), dim=-1)
            token = scripted.get(request_id, int(torch.multinomial(logprobs.exp(), 1)))
            logprob = float(logprobs[token])
            result[request_id] = SampledToken(token, logprob, int((logprobs >= logprob).sum()))
        return result

    def append(self, request: Request, token_id: int) -> None:
        request.output_token_ids.append(token_id)

    def finish(self, requests: list[Request]) -> None:
        pass


def sampler_for(vocab_size: int, max_model_len: int) -> VllmSampler | TorchSampler:
    """vLLM's own sampling where vLLM imports, else the labelled fallback."""
    try:
        return VllmSampler(vocab_size, max_model_len)
    except ImportError as error:
        return TorchSampler(f"vLLM is not importable ({error!r}): raw log-probs of the model's own distribution")
