"""V2's log-prob read from the model's bf16 logits (``patches/sampling_parity/v2_log_softmax.py``): the values of V2's
own kernels on the float32 copy (Triton's interpreter, vLLM's source), the order of V2's compiled kernel (the layouts
Triton gives both for an H100, compiled here without a GPU), and the check that decides whether it is used
(``engine_steps.read_by_kernel``: the engine's bits at positions of the first call, else the copy, said once)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
import torch

from trl_vlm_fixes.patches.sampling_parity import engine_steps, processed, v1_log_softmax, v2_log_softmax
from trl_vlm_fixes.patches.sampling_parity.distribution import V2_RUNNER
from trl_vlm_fixes.selftest import v2_kernels

VOCABULARY = 4144  # 16 x 259: four whole blocks of 1,024 and a masked tail of 48


def _logits(rows: int, seed: int, vocabulary: int = VOCABULARY) -> torch.Tensor:
    """bf16 rows of a trained model's spread (~2.5 nats of entropy; ties on the bf16 grid)."""
    return (torch.randn(rows, vocabulary, generator=torch.Generator().manual_seed(seed)) * 4.5).to(torch.bfloat16)


def _drawn(logits: torch.Tensor, temperature: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator).squeeze(1)


@pytest.fixture(scope="module")
def engine() -> v2_kernels.Engine:
    """V2's temperature and log-softmax kernels from vLLM's source, interpreted (``selftest/v2_kernels.py``)."""
    try:
        return v2_kernels.Engine(torch.device("cpu"))
    except v2_kernels.V2Unavailable as reason:
        pytest.skip(str(reason))


@pytest.fixture(scope="module")
def reader() -> Callable[..., torch.Tensor]:
    return v2_kernels.interpreted_reader()


def _engine_log_probs(
    engine: v2_kernels.Engine, logits: torch.Tensor, ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    """What V2 reports: a float32 copy, its temperature kernel, ``compute_token_logprobs``."""
    return engine.logprobs(engine.temperature(logits, temperature), ids.unsqueeze(1))


@pytest.fixture(autouse=True)
def fresh_verdicts() -> Iterator[None]:
    engine_steps._verdicts.clear()
    yield
    engine_steps._verdicts.clear()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kernel_gives_v2s_log_prob_from_bf16_logits(
    engine: v2_kernels.Engine, reader: Callable[..., torch.Tensor], temperature: float
) -> None:
    """The kernel on the bf16 logits gives what V2's own kernels give on the float32 copy after V2's temperature
    kernel, bit for bit (both interpreted), at each row's likeliest token (log-prob near 0: the row sum's last bits)
    and at a drawn one, over four whole blocks and a masked tail."""
    logits = _logits(24, seed=1)
    for ids in (logits.float().argmax(dim=-1), _drawn(logits, temperature, seed=2)):
        read = reader(logits, ids, temperature)
        expected = _engine_log_probs(engine, logits, ids, temperature)
        assert torch.isfinite(expected).all() and (expected < 0).all()
        assert torch.equal(read, expected)
    # the temperature is applied: at 1 the kernel gives other values where V2 divides
    if temperature != 1.0:
        assert not torch.equal(reader(logits, ids, 1.0), expected)


def test_kernel_reads_chosen_positions_of_trls_strided_logits(
    engine: v2_kernels.Engine, reader: Callable[..., torch.Tensor]
) -> None:
    """TRL 1.9.1's logits are a view ``[completions, positions + 1, vocabulary][:, :-1]``: the kernel reads the
    positions asked for in place (no copy), each as V2 reports it."""
    full = _logits(3 * 9, seed=3).reshape(3, 9, VOCABULARY)
    view = full[:, :-1]
    rows = torch.tensor([0, 5, 7, 8, 12, 23])  # flat over [3, 8]
    ids = _drawn(view.reshape(-1, VOCABULARY), 0.8, seed=4)
    read = reader(view, ids[rows], 0.8, rows)
    expected = _engine_log_probs(engine, view.reshape(-1, VOCABULARY)[rows], ids[rows], 0.8)
    assert torch.equal(read, expected)


def test_kernel_refuses_what_would_change_its_layout() -> None:
    """A vocabulary Triton would not mark 16-aligned, or positions not starting at a multiple of 4 logits, would give
    the kernel's load another layout than V2's: refused, with the reason."""
    assert "16-aligned" in (v2_log_softmax.kernel_fits(VOCABULARY + 4) or "")
    assert v2_log_softmax.kernel_fits(151_936) is None and v2_log_softmax.kernel_fits(248_320) is None
    shifted = _logits(2, seed=5, vocabulary=VOCABULARY + 2)[:, 2:]  # rows VOCABULARY + 2 apart
    with pytest.raises(ValueError, match="multiples of 4 logits"):
        v2_log_softmax.kernel_log_probs(shifted, torch.zeros(2, dtype=torch.int64), 1.0)


_LAYOUTS = """
import json, re, subprocess, tempfile, importlib.util
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trl_vlm_fixes.patches.sampling_parity import v2_log_softmax
from trl_vlm_fixes.selftest import v2_kernels

TYPES = {"temperature": "fp32", "topk": "i32", "vocab_size": "i32", "logits_stride": "i64", "topk_ids_stride": "i64",
         "expanded_idx_mapping_ptr": "*i32", "temperature_ptr": "*fp32", "topk_ids_ptr": "*i64",
         "offsets_ptr": "*i64", "ids_ptr": "*i64", "output_ptr": "*fp32", "out_ptr": "*fp32"}
# the JIT marks pointers and integers divisible by 16 as such (vLLM's tensors, a 151,936- or 248,320-token row)
ALIGNED = {"logits_ptr", "output_ptr", "out_ptr", "topk_ids_ptr", "offsets_ptr", "ids_ptr", "temperature_ptr",
           "expanded_idx_mapping_ptr", "logits_stride", "vocab_size"}

def vllm_module(name):  # V2's source with the real triton (not interpreted: compiled)
    spec = importlib.util.find_spec(f"{v2_kernels.V2_SAMPLE}.{name}")
    source = v2_kernels._TRITON_IMPORT.sub(v2_kernels._REAL_TRITON, Path(spec.origin).read_text())
    path = Path(tempfile.mkdtemp()) / f"v2_{name}.py"
    path.write_text(source)
    loaded = importlib.util.spec_from_file_location(f"v2_{name}", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module

def compiled(fn, logits_dtype, constants, **options):  # the signature from the kernel's own parameters
    names = fn.arg_names
    signature = {name: "constexpr" if name in constants else TYPES.get(name, "*" + logits_dtype) for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in ALIGNED}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options}).asm

def summed(asm):  # each sum's input: the layout of what reshape(allow_reorder) took, then the reduced layout
    ttgir = asm["ttgir"]
    defs = dict(re.findall(r"^(#\\w+) = (#ttg\\.\\w+<.*>)$", ttgir, re.M))
    block = r"tensor<1024xf32, (#\\w+)>"
    pairs = re.findall(r"tt\\.reshape %\\S+ allow_reorder : " + block + " -> " + block, ttgir)
    reduced = re.findall(r"\\}\\) : \\(tensor<1024xf32, (#\\w+)>\\) -> f32", ttgir)
    return {"reshaped": [[defs[a], defs[b]] for a, b in pairs], "reduced": [defs[c] for c in reduced]}

def divisions(asm):
    return sorted(set(re.findall(r"\\bdiv\\.[a-z.]*f32", asm["ptx"])))

def fused(asm):  # FFMA instructions in the machine code: a product and a sum rounded once
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    cubin = Path(tempfile.mkdtemp()) / "kernel.cubin"
    cubin.write_bytes(asm["cubin"])
    listing = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return len(re.findall(r"\\bFFMA\\b", listing))

logprob, gumbel = vllm_module("logprob"), vllm_module("gumbel")
report = {}
for dtype in ("fp32", "bf16"):
    asm = compiled(logprob._topk_log_softmax_kernel, dtype, {"BLOCK_SIZE": 1024, "TOPK_BLOCK_SIZE": 1})
    report[f"vllm_{dtype}"], report[f"vllm_{dtype}_fused"] = summed(asm), fused(asm)
asm = compiled(gumbel._temperature_kernel, "fp32", {"BLOCK_SIZE": 8192})
report["vllm_temperature_divisions"], report["vllm_temperature_fused"] = divisions(asm), fused(asm)
for scale in (False, True):
    constants = {"SCALE": scale, "BLOCK_SIZE": 1024, "PER_THREAD": v2_log_softmax.PER_THREAD}
    asm = compiled(v2_log_softmax._v2_log_prob_kernel, "bf16", constants, enable_fp_fusion=False)
    report[f"fix_scale_{scale}"] = summed(asm)
    report[f"fix_scale_{scale}_divisions"], report[f"fix_scale_{scale}_fused"] = divisions(asm), fused(asm)
asm = compiled(v2_log_softmax._v2_log_prob_kernel, "bf16", constants, enable_fp_fusion=True)
report["fix_fusing_fused"] = fused(asm)  # the first version: compiled with fusion
print(json.dumps(report))
"""


def test_kernel_takes_v2s_float32_layout_for_hopper() -> None:
    """``tl.sum``'s order is its tensor's layout (which logits each thread holds), and Triton picks the layout from the
    load: compiled for an H100 (sm_90; no GPU needed) with the kernels' own parameters, V2's own kernel sums float32
    blocks in one layout, and on bf16 logits in another (the bug a plain bf16 read would have: another summation
    order); the fix's kernel on bf16 logits sums in V2's float32 layout, with or without a temperature, whose
    division is the instruction V2's temperature kernel divides with, each quotient rounded before the max is
    subtracted: its machine code has the fused multiply-adds of V2's two kernels, no more (compiled with fusion, as
    its first version was, it has more: other bits at T = 0.7 on an H200). In a fresh process (a process that ran
    Triton's interpreter cannot compile)."""
    pytest.importorskip("vllm")
    result = subprocess.run([sys.executable, "-c", _LAYOUTS], capture_output=True, text=True, timeout=300)
    if result.returncode and "ptxas" in result.stderr:
        pytest.skip(f"Triton cannot assemble for CUDA here: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    float32_sums = report["vllm_fp32"]
    assert len(float32_sums["reshaped"]) == len(float32_sums["reduced"]) == 2, report  # the max and the sum
    assert report["vllm_bf16"] != float32_sums  # V2's kernel reading bf16 would sum in another order
    assert report["fix_scale_False"] == report["fix_scale_True"] == float32_sums, report
    assert report["vllm_temperature_divisions"], report
    assert report["fix_scale_True_divisions"] == report["vllm_temperature_divisions"]
    assert report["fix_scale_False_divisions"] == []
    fused_in_v2 = report["vllm_fp32_fused"] + report["vllm_temperature_fused"]
    assert report["fix_scale_True_fused"] == report["fix_scale_False_fused"] == fused_in_v2, report
    assert report["fix_fusing_fused"] > fused_in_v2, report


@pytest.fixture
def v2_kernel_on_cpu(
    engine: v2_kernels.Engine, reader: Callable[..., torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """The V2 read on the CPU: the interpreted kernel for the compiled one, V2's interpreted kernels as the engine
    (the reference of the check and of the copy path); returns the positions each kernel call read."""
    calls: list[int] = []

    def interpreted(logits, ids, temperature, rows=None):  # type: ignore[no-untyped-def]
        read = reader(logits, ids, temperature, rows)
        calls.append(read.numel())
        return read

    monkeypatch.setattr(engine_steps, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(engine_steps, "uses_v2_kernel", lambda runner, device: runner == V2_RUNNER)
    monkeypatch.setattr(v2_log_softmax, "kernel_log_probs", interpreted)
    monkeypatch.setattr(
        engine_steps,
        "copied_log_probs",
        lambda logits, ids, temperature, runner: _engine_log_probs(engine, logits, ids, temperature),
    )
    return calls


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_v2_positions_read_by_kernel_once_it_gave_v2s_bits(
    v2_kernel_on_cpu: list[int], engine: v2_kernels.Engine, caplog: pytest.LogCaptureFixture, temperature: float
) -> None:
    """Where the engine runs V2, ``Positions.plain_log_probs`` on TRL 1.9.1's strided logits with completion lengths:
    the check reads 64 positions at two tokens each, finds V2's bits, and one launch reads every scored position
    (none after a completion's end), each V2's own at the temperature; one INFO line says so."""
    full = _logits(4 * 33, seed=6).reshape(4, 33, VOCABULARY)
    view, lengths = full[:, :-1], [32, 20, 32, 9]
    ids = _drawn(view.reshape(-1, VOCABULARY), temperature, seed=7)
    positions = processed.Positions(torch.zeros(4, 32, 1), None, view, lengths)
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        plain = positions.plain_log_probs(temperature, ids, V2_RUNNER)
    scored = sum(lengths)
    assert v2_kernel_on_cpu == [2 * engine_steps.CHECK_POSITIONS, scored]
    mask = torch.arange(32)[None, :] < torch.tensor(lengths)[:, None]
    expected = _engine_log_probs(engine, view[mask], ids[mask.reshape(-1)], temperature)
    assert torch.equal(plain.reshape(4, 32)[mask], expected)
    key = (V2_RUNNER, view.device, view.dtype, VOCABULARY, temperature != 1.0)
    assert engine_steps._verdicts == {key: True}
    assert any("had the bits of V2's log-softmax kernel" in r.getMessage() for r in caplog.records)


def test_kernel_skips_the_division_where_v2_does(
    engine: v2_kernels.Engine, reader: Callable[..., torch.Tensor]
) -> None:
    """V2's temperature kernel returns early at temperature 0 (and 1): the kernel divides nowhere there either, so a
    verdict earned at another temperature (the same key: a division) never reads a division by 0."""
    logits = _logits(8, seed=16)
    ids = logits.float().argmax(dim=-1)
    read = reader(logits, ids, 0.0)
    assert torch.isfinite(read).all() and torch.equal(read, _engine_log_probs(engine, logits, ids, 0.0))


def test_v2_kernel_not_trusted_where_its_bits_are_not_the_engines(
    v2_kernel_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Against another arithmetic (torch's log_softmax, which V1 reports) the check finds other bits: the copy runs
    from then on, and one WARNING names V2's kernel and the count."""
    monkeypatch.setattr(
        engine_steps,
        "copied_log_probs",
        lambda logits, ids, temperature, runner: torch.log_softmax(logits.float(), -1).gather(1, ids[:, None])[:, 0],
    )
    logits = _logits(80, seed=8)
    ids = _drawn(logits, 1.0, seed=9)
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        assert engine_steps.read_by_kernel(logits, ids, 1.0, V2_RUNNER) is None
        assert engine_steps.read_by_kernel(logits, ids, 1.0, V2_RUNNER) is None
    assert v2_kernel_on_cpu == [2 * engine_steps.CHECK_POSITIONS]
    warnings = [r.getMessage() for r in caplog.records if "kernel was not used" in r.getMessage()]
    assert (
        len(warnings) == 1 and "V2's log-prob" in warnings[0] and "differs from V2's log-softmax kernel" in warnings[0]
    )


def test_v2_read_steps_aside_where_the_positions_are_not_aligned(
    v2_kernel_on_cpu: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Positions that do not start at a multiple of 4 logits would load in another layout: the kernel is never run
    on them, also after a verdict for aligned logits of the same key (checked at every call), the copy runs, and the
    WARNING says why; V1's kernel (no such need) is not held to it."""
    aligned = _logits(80, seed=10)
    assert engine_steps.read_by_kernel(aligned, _drawn(aligned, 1.0, seed=17), 1.0, V2_RUNNER) is not None
    read_before = list(v2_kernel_on_cpu)
    shifted = _logits(80, seed=10, vocabulary=VOCABULARY + 2)[:, 2:]
    ids = _drawn(shifted, 1.0, seed=11)
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        assert engine_steps.read_by_kernel(shifted, ids, 1.0, V2_RUNNER) is None
    assert v2_kernel_on_cpu == read_before == [2 * engine_steps.CHECK_POSITIONS, 80]
    assert any("multiples of 4 logits" in r.getMessage() for r in caplog.records)
    assert v2_log_softmax.unreadable(shifted) is not None and v1_log_softmax.unreadable(shifted) is None
    assert v2_log_softmax.unreadable(aligned.double()) is not None  # float64: 2 values a thread


def test_v2_read_needs_v2s_kernels(v2_kernel_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where V2's own kernels do not run (no Triton for vLLM), the copy path computes torch's log_softmax, which the
    kernel is not: the kernel is not even checked."""
    monkeypatch.setattr(engine_steps, "uses_v2_kernel", lambda runner, device: False)
    logits = _logits(80, seed=12)
    assert engine_steps.read_by_kernel(logits, _drawn(logits, 1.0, seed=13), 1.0, V2_RUNNER) is None
    assert v2_kernel_on_cpu == [] and engine_steps._verdicts == {}
