"""sampling_parity's one-pass log-prob kernel (``fused_logprob``), run by Triton's interpreter: it gives what the
torch path gives (vLLM's float32 arithmetic) where nothing is cut or a ban alone, and the scorer takes it wherever
the kernel is there for TRL's logits (on a GPU: compiled; its GPU record is benchmarks/gpu/fused_logprob_check.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from trl_vlm_fixes.patches.sampling_parity import fused_logprob, processed
from trl_vlm_fixes.patches.sampling_parity.distribution import V1_RUNNER, V2_RUNNER, SamplingDistribution
from trl_vlm_fixes.selftest.fused_kernel import InterpretedKernel

VOCABULARY = 2048
PLACEHOLDERS = tuple(range(VOCABULARY - 8, VOCABULARY))


@pytest.fixture(scope="module")
def interpreted() -> InterpretedKernel:
    if fused_logprob.triton is None:
        pytest.skip("no Triton")
    return InterpretedKernel()


@pytest.fixture(autouse=True)
def fresh_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process does: the kernel not yet judged."""
    monkeypatch.setattr(fused_logprob, "verdict", fused_logprob.Verdict())


def bf16_logits(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A trained model's spread (~2.5 nats) on bf16's grid; tokens sampled from it; a placeholder on top in every 8th
    position (the ban holds most of the mass there) and sampled in others (a banned token sampled is kept)."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, width, VOCABULARY, generator=generator) * 2.5).to(torch.bfloat16)
    logits[:, ::8, VOCABULARY - 1] = 30.0
    probabilities = torch.softmax(logits.float().view(-1, VOCABULARY), dim=-1)
    ids = torch.multinomial(probabilities, 1, generator=generator).squeeze(1)
    ids[::8] = 5  # an ordinary token sampled where a placeholder holds most of the mass
    ids[3::8] = PLACEHOLDERS[2]
    return logits, ids


def scored(
    logits: torch.Tensor, ids: torch.Tensor, distribution: SamplingDistribution, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scorer's (shift + TRL's log-prob, log_kept) for TRL's whole call, as the output layer's hook scores it."""
    positions = processed.Positions(logits[:, :, :1].float(), None, logits, lengths)
    trl = torch.full((ids.numel(),), -3.0)
    shift, log_kept = processed.Scorer(distribution, distribution.temperature).score(positions, ids).finish(trl)
    return shift + trl, log_kept


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "runner": V1_RUNNER},
        {"temperature": 0.7, "runner": V2_RUNNER},
        {"temperature": 1.0, "banned": PLACEHOLDERS},
        {"temperature": 0.8, "banned": PLACEHOLDERS, "runner": V2_RUNNER},
    ],
    ids=["plain", "t0.7-v1", "t0.7-v2", "ban", "ban-t0.8-v2"],
)
def test_the_kernel_gives_the_torch_paths_log_probs(
    settings: dict[str, Any], interpreted: InterpretedKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same log-probs and kept shares as the torch path (vLLM's float32 log_softmax; with a ban, full rows where it
    holds most of the mass) within float32's rounding, no bias; TRL's own past each completion's end."""
    distribution = SamplingDistribution(**settings)
    logits, ids = bf16_logits(3, 48)
    lengths = [48, 30, 7]
    torch_path = scored(logits, ids, distribution, lengths)
    monkeypatch.setattr(fused_logprob, "kernel", lambda _logits: interpreted)
    before = interpreted.positions
    fused = scored(logits, ids, distribution, lengths)
    assert interpreted.positions - before == ids.numel(), "the scorer took the kernel, one program per position"
    assert fused_logprob.verdict.trusted is True, "the kernel's own values, not the torch path's after a refusal"
    ends = torch.arange(48)[None, :] < torch.tensor(lengths)[:, None]
    scored_positions = ends.reshape(-1)
    assert int(scored_positions.sum()) == 85
    for ours, theirs in zip(fused, torch_path, strict=True):
        assert torch.isfinite(ours[scored_positions]).all() and torch.isfinite(theirs[scored_positions]).all()
        gap = (ours - theirs)[scored_positions].double()
        assert gap.abs().max() < 4e-6, gap.abs().max()
        assert abs(float(gap.mean())) < 5e-7
    assert (fused[0][~scored_positions] == -3.0).all(), "padding keeps TRL's log-prob"
    if distribution.banned:  # the ban took mass: the kept share is below 1 where a placeholder is on top
        dominant = torch.zeros(3, 48, dtype=torch.bool)
        dominant[:, ::8] = True
        dominant = dominant.reshape(-1) & scored_positions
        assert bool(dominant.any()) and (fused[1][dominant] < -10).all()
        assert (fused[1][scored_positions] <= 0).all()


def test_the_kernel_applies_the_engines_temperature_step(interpreted: InterpretedKernel) -> None:
    """At a temperature other than 1 the kernel divides (break it: drop the division, and this fails); at 1 the
    log-prob is the plain log-softmax."""
    logits, ids = bf16_logits(1, 16)
    for temperature in (1.0, 0.6):
        with torch.no_grad():
            plain, kept, log_kept = fused_logprob.log_probs(interpreted, logits, ids, None, temperature, V1_RUNNER)
        scaled = logits.float().view(-1, VOCABULARY) / torch.tensor(temperature)
        reference = torch.log_softmax(scaled, dim=-1).gather(1, ids[:, None]).squeeze(1)
        assert (plain - reference).abs().max() < 4e-6
        assert kept is plain and (log_kept == 0).all()
    assert math.isfinite(float(plain.sum()))


class Broken:
    """A build whose launches write nothing sensible (zeros), or raise."""

    def __init__(self, raises: bool) -> None:
        self.raises = raises
        self.launches = 0

    def __getitem__(self, grid: tuple[int]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches += 1
            if self.raises:
                raise RuntimeError("PTX assembly failed")
            for output in args[8:11]:
                output.zero_()

        return launch


@pytest.mark.parametrize("raises", [False, True], ids=["wrong-values", "fails"])
def test_a_kernel_that_fails_or_disagrees_leaves_the_torch_path(
    raises: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first call judges the build against the torch path: a build that raises or disagrees is refused with one
    WARNING, that call and every later one get the torch path's values, and it is never launched again."""
    distribution = SamplingDistribution(temperature=1.0, banned=PLACEHOLDERS)
    logits, ids = bf16_logits(2, 48)
    expected = scored(logits, ids, distribution, [48, 48])
    broken = Broken(raises)
    monkeypatch.setattr(fused_logprob, "kernel", lambda _logits: broken)
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
        first = scored(logits, ids, distribution, [48, 48])
        second = scored(logits, ids, distribution, [48, 48])
    assert broken.launches == 1 and fused_logprob.verdict.trusted is False
    warnings = [r.getMessage() for r in caplog.records if "log-prob kernel is not used" in r.getMessage()]
    assert len(warnings) == 1 and ("PTX assembly failed" in warnings[0] or "differ from the torch path" in warnings[0])
    for result in (first, second):
        for ours, theirs in zip(result, expected, strict=True):
            assert torch.equal(ours, theirs)


def test_a_kernel_whose_gap_is_one_signed_is_refused(
    interpreted: InterpretedKernel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build off by 1e-6 nats per token in one direction (far inside the largest gap allowed, but 2e-3 of the IS
    weight at 2,048 tokens, as an approximate ``exp`` could be) is refused: its mean gap is not rounding's."""

    class Biased:
        def __getitem__(self, grid: tuple[int]) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                interpreted[grid](*args, **kwargs)
                args[8].add_(1e-6)  # the plain log-prob
                args[9].add_(1e-6)  # the kept one (a ban: its own tensor)

            return launch

    distribution = SamplingDistribution(temperature=1.0, banned=PLACEHOLDERS)
    logits, ids = bf16_logits(2, 48)
    expected = scored(logits, ids, distribution, [48, 48])
    monkeypatch.setattr(fused_logprob, "kernel", lambda _logits: Biased())
    with caplog.at_level("WARNING", logger="trl_vlm_fixes"):
        result = scored(logits, ids, distribution, [48, 48])
    assert fused_logprob.verdict.trusted is False
    assert any("(mean 1e-06)" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    for ours, theirs in zip(result, expected, strict=True):
        assert torch.equal(ours, theirs)


def test_a_trusted_kernel_is_judged_once(
    interpreted: InterpretedKernel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first call compares with the torch path (one INFO line); later calls run the kernel alone."""
    distribution = SamplingDistribution(temperature=1.0, banned=PLACEHOLDERS)
    logits, ids = bf16_logits(2, 48)
    monkeypatch.setattr(fused_logprob, "kernel", lambda _logits: interpreted)
    torch_path_calls = []
    original_ban = processed.Scorer._ban
    monkeypatch.setattr(
        processed.Scorer, "_ban", lambda self, *args: torch_path_calls.append(1) or original_ban(self, *args)
    )
    with caplog.at_level("INFO", logger="trl_vlm_fixes"):
        scored(logits[:, :16], ids.view(2, 48)[:, :16].reshape(-1), distribution, [16, 16])  # too few to judge
        assert fused_logprob.verdict.trusted is None and len(torch_path_calls) == 1
        for _ in range(3):
            scored(logits, ids, distribution, [48, 48])
    assert fused_logprob.verdict.trusted is True and len(torch_path_calls) == 2
    assert sum("agrees with the torch path" in r.getMessage() for r in caplog.records) == 1


COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trl_vlm_fixes.patches.sampling_parity import fused_logprob

names = ("logits_ptr row_stride position_stride width lengths_ptr ids_ptr banned_ptr temperature plain_ptr kept_ptr "
         "log_kept_ptr vocabulary").split()
found = {}
for dtype in ("*bf16", "*fp32"):
    types = [dtype, "i64", "i64", "i32", "*i64", "*i64", "*i64", "fp32", "*fp32", "*fp32", "*fp32", "i32"]
    signature = dict(zip(names, types))
    signature.update({name: "constexpr" for name in ("BANNED", "SCALE", "ACCURATE", "BLOCK_SIZE")})
    for banned in (0, 8):
        for scale in (0, 1, 2):
            constants = {(12,): banned, (13,): scale, (14,): True, (15,): fused_logprob.BLOCK}
            source = ASTSource(fused_logprob._compiled(), signature, constants)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            ptx = compiled.asm["ptx"]
            found[f"{dtype} {banned} {scale}"] = {
                "cubin": len(compiled.asm["cubin"]),
                "div.rn.f32": "div.rn.f32" in ptx,
                "div.full.f32": "div.full.f32" in ptx,
            }
print(json.dumps(found))
"""


@pytest.mark.stack_independent  # Triton's code generator (3.8 on both stacks), no TRL/vLLM code
def test_the_kernel_compiles_for_a_hopper_gpu(tmp_path: Path) -> None:
    """Triton's code generator (which the interpreter never runs) turns every variant into a cubin for an H100, with
    IEEE division under V1's step, Triton's approximate one (what vLLM's V2 temperature kernel's ``/`` compiles to)
    under V2's, none at temperature 1. A fresh process and an empty Triton cache: the code generator runs (an
    interpreted kernel earlier in a process leaves ``triton.language`` unfit to compile)."""
    environment = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(found) == 12
    for variant, facts in found.items():
        scale = int(variant.split()[-1])
        assert facts["cubin"] > 0, variant
        assert facts["div.rn.f32"] == (scale == 1) and facts["div.full.f32"] == (scale == 2), (variant, facts)


def test_no_kernel_for_cpu_logits() -> None:
    """On the CPU the torch path runs (the compiled kernel is for CUDA tensors only)."""
    assert fused_logprob.kernel(torch.zeros(1, 1, 4)) is None
