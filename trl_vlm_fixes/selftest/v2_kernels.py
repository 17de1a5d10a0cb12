"""vLLM's V2 model runner's sampling kernels (``vllm/v1/worker/gpu/sample/``) where they can run: vLLM's own modules on
a GPU; on a machine without one, their source executed with the real triton in Triton's interpreter (vLLM's
``triton_utils`` gives placeholders without a GPU driver), as ``kernel_copy`` runs its top-k/top-p kernel. For the
tests and the GPU record of what V2 computes against what the trainer computes (``tests/test_v2_runner.py``,
``benchmarks/gpu/v2_sampler_kernels.py``)."""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..patches.sampling_parity import kernel_copy, v2_log_softmax
from ..patches.sampling_parity.engine_steps import V2_SAMPLE

MODULES = ("gumbel", "min_p", "logprob")  # the temperature, min-p and log-softmax kernels
_TRITON_IMPORT = re.compile(r"^from vllm\.triton_utils import [^\n]+$", re.MULTILINE)
_REAL_TRITON = "import triton\nimport triton.language as tl\nHAS_TRITON = True\ntldevice = None"


class V2Unavailable(RuntimeError):
    """This vLLM has no V2 sampling modules, or neither a GPU nor triton's interpreter can run them."""


def interpreted_module(name: str) -> dict[str, Any]:
    """One of V2's sampling modules, its source executed with the real triton, its kernels decorated in interpreter
    mode (run them inside ``kernel_copy.interpreting()``)."""
    try:
        spec = importlib.util.find_spec(f"{V2_SAMPLE}.{name}")
        import triton  # noqa: F401 - the interpreter is triton's
    except ImportError as error:
        raise V2Unavailable(f"vLLM's V2 sampling modules or triton are not importable here: {error}") from error
    if spec is None or spec.origin is None:
        raise V2Unavailable(f"this vLLM has no {V2_SAMPLE}.{name}")
    source = Path(spec.origin).read_text()
    if len(_TRITON_IMPORT.findall(source)) != 1:
        raise V2Unavailable(f"{spec.origin}: its triton import is not the one line this copy replaces")
    return kernel_copy.executed_in_interpreter(_TRITON_IMPORT.sub(_REAL_TRITON, source), f"trl_vlm_fixes_v2_{name}")


def kernels(on_gpu: bool) -> SimpleNamespace:
    """``apply_temperature``, ``apply_min_p``, ``compute_token_logprobs``: vLLM's own on a GPU, else interpreted."""
    if on_gpu:
        modules = {name: vars(importlib.import_module(f"{V2_SAMPLE}.{name}")) for name in MODULES}
    else:
        modules = {name: interpreted_module(name) for name in MODULES}
    return SimpleNamespace(
        apply_temperature=modules["gumbel"]["apply_temperature"],
        apply_min_p=modules["min_p"]["apply_min_p"],
        compute_token_logprobs=modules["logprob"]["compute_token_logprobs"],
    )


_READER_IMPORT = "from .v1_log_softmax import launched"


def interpreted_reader() -> Callable[..., torch.Tensor]:
    """``v2_log_softmax.kernel_log_probs`` with its kernel in Triton's interpreter (CPU tensors; the interpreter runs
    its ``tl.exp``/``tl.log``/``/`` in numpy's float32, as it runs V2's own kernels: each operation rounded on its
    own there, as the kernel is compiled without fusion)."""
    source = Path(v2_log_softmax.__file__).read_text()
    if _READER_IMPORT not in source:
        raise RuntimeError(f"v2_log_softmax no longer has the line {_READER_IMPORT!r}: update its interpreted copy")
    absolute = _READER_IMPORT.replace("from .", "from trl_vlm_fixes.patches.sampling_parity.")
    source = source.replace(_READER_IMPORT, absolute)
    namespace = kernel_copy.executed_in_interpreter(source, "trl_vlm_fixes_v2_reader")

    def kernel_log_probs(
        logits: torch.Tensor, ids: torch.Tensor, temperature: float, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        with kernel_copy.interpreting():
            return namespace["kernel_log_probs"](
                logits, ids, temperature, rows, kernel=namespace["_v2_log_prob_kernel"]
            )

    return kernel_log_probs


TemperatureKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class Engine:
    """One V2 engine step's arithmetic (``Sampler.sample`` then ``compute_token_logprobs``): a float32 copy, the
    temperature kernel, the min-p kernel, the top-k/top-p every routed engine step takes (``vllm_rule``), a draw, the
    sampled token's processed log-prob. vLLM's kernels compiled on a GPU, interpreted on a CPU; ``temperature_kernel``
    replaces V2's (a stand-in for what it computes compiled, where that is not what the interpreter computes)."""

    def __init__(self, device: torch.device, temperature_kernel: TemperatureKernel | None = None) -> None:
        self.on_gpu = device.type == "cuda"
        self.kernels = kernels(self.on_gpu)
        self.temperature_kernel = temperature_kernel or self.kernels.apply_temperature

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        if self.on_gpu:
            return function(*args)
        with kernel_copy.interpreting():
            return function(*args)

    def temperature(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """A float32 copy ("Copy logits to a new FP32 tensor") at ``temperature``."""
        work = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
        if temperature not in (0.0, 1.0):  # SamplingStates.apply_temperature skips the kernel then
            temperatures = torch.full((logits.size(0),), temperature, device=logits.device)
            self.run(self.temperature_kernel, work, _mapping(work), temperatures)
        return work

    def min_p(self, work: torch.Tensor, min_p: float) -> int:
        """The min-p kernel, in place: how many tokens it cut."""
        finite = int(torch.isfinite(work).sum())
        self.run(self.kernels.apply_min_p, work, _mapping(work), torch.full((work.size(0),), min_p, device=work.device))
        return finite - int(torch.isfinite(work).sum())

    def step(self, logits: torch.Tensor, distribution: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(sampled ids [rows, 1], their processed log-probs [rows], tokens the min-p kernel cut)."""
        from ..patches.sampling_parity import vllm_rule

        rows, device = logits.size(0), logits.device
        work = self.temperature(logits, distribution.temperature)
        cut_by_min_p = self.min_p(work, distribution.min_p) if distribution.min_p > 0.0 else 0
        k = torch.full((rows,), distribution.top_k, dtype=torch.int32, device=device) if distribution.top_k else None
        p = torch.full((rows,), distribution.top_p, device=device) if distribution.top_p < 1.0 else None
        work = vllm_rule.top_k_top_p(work, k, p)
        generator = torch.Generator(device=device).manual_seed(seed)
        ids = torch.multinomial(torch.softmax(work, dim=-1), 1, generator=generator)
        return ids, self.logprobs(work, ids), cut_by_min_p

    def logprobs(self, work: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.run(self.kernels.compute_token_logprobs, work, ids).squeeze(1)


def _mapping(work: torch.Tensor) -> torch.Tensor:
    """Request i's state is row i."""
    return torch.arange(work.size(0), dtype=torch.int32, device=work.device)


def min_p_boundary_rows(
    rows: int, vocabulary: int, min_p: float, temperature: float, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Up to ``rows`` rows whose token 1 sits where V1's min-p rule (prob < min_p * max prob) and V2's (logit < max +
    log(min_p)) disagree, by torch's float32 arithmetic on ``device``: each row random tokens, token 0 the largest,
    token 1's logit walked over the 512 float32 values around V2's threshold (about one of them is such a value)."""
    log_min_p = torch.log(torch.tensor(min_p, dtype=torch.float32, device=device))
    found: list[torch.Tensor] = []
    for seed in range(8 * rows):
        row = (torch.randn(vocabulary, generator=torch.Generator().manual_seed(seed)) * 2.0).to(device)
        row[0] = 8.0  # the largest logit
        threshold = ((8.0 / temperature + log_min_p) * temperature).reshape(1)
        steps = torch.arange(-256, 256, dtype=torch.int32, device=device)
        candidates = row.repeat(len(steps), 1)
        candidates[:, 1] = (threshold.view(torch.int32) + steps).view(torch.float32)  # consecutive float32 values
        scaled = candidates / temperature
        v2_cut = scaled[:, 1] < scaled.amax(dim=-1) + log_min_p
        probs = torch.softmax(scaled, dim=-1)
        v1_cut = probs[:, 1] < probs.amax(dim=-1) * min_p
        found += [candidates[index] for index in (v1_cut != v2_cut).nonzero().squeeze(1)[:1]]
        if len(found) == rows:
            break
    return torch.stack(found) if found else torch.empty(0, vocabulary, device=device)
