"""V1's log-prob read from the model's bf16 logits by ``v1_log_softmax``'s kernel (torch's CUDA summation order, no
float32 copy), and the fix's use of it only where it gave torch's own bits.

Here the kernel runs in Triton's interpreter (``selftest/interpreted_v1.py``) and is held, bit for bit, to the same
order written in torch operations (``emulated_log_probs``); that the order is torch's CUDA kernel's is the GPU
record's to show (benchmarks/gpu/v1_log_softmax.py: not yet run; until then the check below decides on each
machine). The check that gates the kernel is run
here with a kernel that does not give torch's bits (the interpreted one against torch's CPU function) and with one
that does, and the plumbing of TRL's strided logits, completion lengths and token ids through the kernel is shown on
a [rows, positions, vocabulary] view as TRL 1.9.1 holds it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import pytest
import torch

from trl_vlm_fixes.log_once import forget
from trl_vlm_fixes.patches.sampling_parity import engine_steps, v1_log_softmax, v2_log_softmax
from trl_vlm_fixes.patches.sampling_parity.distribution import V1_RUNNER, V2_RUNNER
from trl_vlm_fixes.patches.sampling_parity.processed import OutputLayer, Positions
from trl_vlm_fixes.selftest import interpreted_v1

triton = pytest.importorskip("triton")

# above torch's shared-memory kernel's bound; 4 whole 4,096-element steps and a tail of 2,560 (3 tail steps)
VOCABULARY = 4 * 4096 + 2560


def _logits(rows: int, vocabulary: int, seed: int, spread: float = 4.5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocabulary, generator=generator) * spread).to(torch.bfloat16)


def _ids(rows: int, vocabulary: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocabulary, (rows,), generator=torch.Generator().manual_seed(seed))


def _likely(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token: its log-prob is near 0, where float32 resolves the row sum's last bits (a
    uniformly drawn token's, near -20, rounds them away)."""
    return logits.float().argmax(dim=-1)


@pytest.fixture(autouse=True)
def fresh_verdicts() -> Iterator[None]:
    engine_steps._verdicts.clear()
    forget()
    yield
    engine_steps._verdicts.clear()
    forget()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocabulary", [12_800, VOCABULARY])
def test_kernel_sums_in_the_modelled_order_bit_for_bit(vocabulary: int, temperature: float) -> None:
    """The interpreted kernel gives the emulated order's bits on every row, from bf16 and float32 logits (the
    upcast is exact); another order (torch's CPU ``log_softmax``) does not, so bit equality is not a given."""
    logits = _logits(48, vocabulary, seed=1)
    ids = _likely(logits)
    order = interpreted_v1.emulated_log_probs(logits, ids, temperature)
    from_bf16 = interpreted_v1.kernel_log_probs(logits, ids, temperature)
    from_float32 = interpreted_v1.kernel_log_probs(logits.float(), ids, temperature)
    assert torch.equal(from_bf16, order) and torch.equal(from_float32, order)
    other = torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, ids[:, None]).squeeze(1)
    assert (other != order).any(), "another summation order gives other bits somewhere"
    assert (other - order).abs().max() < 1e-5  # the same log-prob otherwise


def test_kernel_reads_chosen_positions_of_a_strided_view() -> None:
    """TRL 1.9.1's logits are a [rows, positions, vocabulary] view with a gap after each row (its last position
    dropped): the kernel reads the positions it is given there, with their own token ids."""
    whole = _logits(3 * 9, VOCABULARY, seed=3).reshape(3, 9, VOCABULARY)
    view = whole[:, :-1, :]  # strides (9 V, V, 1): not reshapeable without a copy
    assert not view.is_contiguous()
    rows = torch.tensor([0, 1, 2, 8, 9, 17, 23])  # flat over (3, 8)
    ids = _ids(rows.numel(), VOCABULARY, seed=4)
    read = interpreted_v1.kernel_log_probs_at(view, ids, 0.7, rows)
    gathered = view.reshape(-1, VOCABULARY)[rows]
    assert torch.equal(read, interpreted_v1.emulated_log_probs(gathered, ids, 0.7))


def test_kernel_refuses_vocabularies_of_another_kernel() -> None:
    """A row that fits torch's shared-memory kernel, or is no whole number of float4 vectors, is summed in another
    order: the kernel says so rather than give other bits."""
    assert "shared-memory" in (v1_log_softmax.kernel_fits(12_000) or "")
    assert "float4" in (v1_log_softmax.kernel_fits(VOCABULARY + 2) or "")
    assert v1_log_softmax.kernel_fits(151_936) is None and v1_log_softmax.kernel_fits(248_320) is None
    with pytest.raises(ValueError, match="shared-memory"):
        v1_log_softmax.kernel_log_probs(_logits(2, 12_000, seed=5), torch.zeros(2, dtype=torch.int64), 1.0)


@pytest.fixture
def kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The fix's kernel path on the CPU: the interpreted kernel stands for the compiled one; returns the number of
    positions each kernel call read."""
    calls: list[int] = []

    def interpreted(logits, ids, temperature, rows=None):  # type: ignore[no-untyped-def]
        read = interpreted_v1.kernel_log_probs_at(logits, ids, temperature, rows)
        calls.append(read.numel())
        return read

    monkeypatch.setattr(engine_steps, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(v1_log_softmax, "kernel_log_probs", interpreted)
    return calls


def test_kernel_not_trusted_where_its_bits_are_not_torchs(
    kernel_on_cpu: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """Against torch's CPU function (another order) the kernel's bits differ: the float32 copy runs, exact, from
    then on, and one WARNING says why; the kernel ran once, for the check."""
    logits, ids = _logits(80, VOCABULARY, seed=6), _ids(80, VOCABULARY, seed=7)
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        first = engine_steps.read_by_kernel(logits, ids, 1.0, V1_RUNNER)
        second = engine_steps.read_by_kernel(logits, ids, 1.0, V1_RUNNER)
    assert first is None and second is None
    assert kernel_on_cpu == [2 * engine_steps.CHECK_POSITIONS]  # each position at two tokens
    warnings = [r.getMessage() for r in caplog.records if "kernel was not used" in r.getMessage()]
    assert len(warnings) == 1 and f"of {2 * engine_steps.CHECK_POSITIONS} log-probs" in warnings[0]


def test_kernel_trusted_where_it_gives_torchs_bits(
    kernel_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the kernel gives torch's own bits (here the reference is made the emulated order, as torch's CUDA
    kernel is on a GPU), the positions are read by the kernel, every one of them, and one INFO line says so."""
    monkeypatch.setattr(
        engine_steps,
        "copied_log_probs",
        lambda logits, ids, temperature, runner: interpreted_v1.emulated_log_probs(logits, ids, temperature),
    )
    logits, ids = _logits(70, VOCABULARY, seed=8), _ids(70, VOCABULARY, seed=9)
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        read = engine_steps.read_by_kernel(logits, ids, 0.7, V1_RUNNER)
    assert read is not None and torch.equal(read, interpreted_v1.emulated_log_probs(logits, ids, 0.7))
    assert kernel_on_cpu == [2 * engine_steps.CHECK_POSITIONS, 70]
    assert any("had the bits of torch's log_softmax" in r.getMessage() for r in caplog.records)


def test_a_trusted_kernel_that_fails_later_gives_way_to_the_copy(
    kernel_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel trusted on its first call that raises on a later one (a new build for other strides that fails) does
    not break the scoring pass: that call and every later one for the key take the float32 copy, said once."""
    monkeypatch.setattr(
        engine_steps,
        "copied_log_probs",
        lambda logits, ids, temperature, runner: interpreted_v1.emulated_log_probs(logits, ids, temperature),
    )
    logits, ids = _logits(70, VOCABULARY, seed=8), _ids(70, VOCABULARY, seed=9)
    assert engine_steps.read_by_kernel(logits, ids, 1.0, V1_RUNNER) is not None
    assert kernel_on_cpu == [2 * engine_steps.CHECK_POSITIONS, 70]  # checked, then read
    failures: list[int] = []

    def failing_build(*args, **kwargs):  # type: ignore[no-untyped-def]
        failures.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(v1_log_softmax, "kernel_log_probs", failing_build)
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        assert engine_steps.read_by_kernel(logits, ids, 1.0, V1_RUNNER) is None
        assert engine_steps.read_by_kernel(logits, ids, 1.0, V1_RUNNER) is None
    assert failures == [1]  # asked once, then the copy without asking
    warnings = [r.getMessage() for r in caplog.records if "failed on a later call" in r.getMessage()]
    assert len(warnings) == 1 and "RuntimeError: PassManager::run failed" in warnings[0], warnings
    assert engine_steps._verdicts == {(V1_RUNNER, logits.device, logits.dtype, VOCABULARY, False): False}


def _tail_first(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The modelled order but each thread's tail elements folded in first: other bits in the last place of the row
    sum only, in a few rows (a near miss)."""
    values = logits.to(torch.float32) / temperature if temperature != 1.0 else logits.to(torch.float32)
    rows, vocabulary = values.shape
    block, full = v1_log_softmax.BLOCK, vocabulary // (4 * v1_log_softmax.BLOCK)
    top = values.amax(dim=-1)
    total = torch.zeros(rows, block)
    for start in range(full * 4 * block, vocabulary, block):
        part = values[:, start : start + block]
        total[:, : part.size(1)] += interpreted_v1.numpy_exp(part - top[:, None])
    body = values[:, : full * 4 * block].reshape(rows, full, block, 4)
    for k in range(full):
        for j in range(4):
            total = total + interpreted_v1.numpy_exp(body[:, k, :, j] - top[:, None])
    row_sum = v1_log_softmax._tree(v1_log_softmax._tree(total.reshape(rows, 32, 32)).reshape(rows, 1, 32))[:, 0]
    chosen = values.gather(1, ids.reshape(-1, 1)).squeeze(1)
    return (chosen - top) - interpreted_v1.numpy_log(row_sum)


def test_the_check_sees_a_near_miss_in_the_row_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose order differs from torch's only in where the tail joins each thread's sum is refused: the check
    reads each position's likeliest token, whose log-prob keeps the sum's last bits (here it shows there at least as
    often as at the drawn tokens: 9 and 6 of 64 positions)."""
    monkeypatch.setattr(engine_steps, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(
        v1_log_softmax,
        "kernel_log_probs",
        lambda logits, ids, temperature, rows=None: _tail_first(logits, ids, temperature),
    )
    monkeypatch.setattr(
        engine_steps,
        "copied_log_probs",
        lambda logits, ids, temperature, runner: interpreted_v1.emulated_log_probs(logits, ids, temperature),
    )
    logits = _logits(64, VOCABULARY, seed=18)
    drawn = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=torch.Generator().manual_seed(19))[:, 0]
    at_drawn = int((_tail_first(logits, drawn, 1.0) != interpreted_v1.emulated_log_probs(logits, drawn, 1.0)).sum())
    likeliest = _likely(logits)
    at_likeliest = _tail_first(logits, likeliest, 1.0) != interpreted_v1.emulated_log_probs(logits, likeliest, 1.0)
    assert int(at_likeliest.sum()) >= max(at_drawn, 1)
    assert engine_steps.read_by_kernel(logits, drawn, 1.0, V1_RUNNER) is None
    assert engine_steps._verdicts == {(V1_RUNNER, logits.device, logits.dtype, VOCABULARY, False): False}


def test_too_few_positions_wait_and_a_failing_build_steps_aside(
    kernel_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A call of fewer positions than the check takes uses torch's function and decides nothing; a kernel that
    cannot be built is said once and torch's function runs."""
    small = _logits(8, VOCABULARY, seed=10)
    assert engine_steps.read_by_kernel(small, _ids(8, VOCABULARY, seed=11), 1.0, V1_RUNNER) is None
    assert kernel_on_cpu == [] and engine_steps._verdicts == {}

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no PTX for this GPU")

    monkeypatch.setattr(v1_log_softmax, "kernel_log_probs", broken)
    logits = _logits(64, VOCABULARY, seed=12)
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        assert engine_steps.read_by_kernel(logits, _ids(64, VOCABULARY, seed=13), 1.0, V1_RUNNER) is None
    assert any("could not run (RuntimeError: no PTX" in r.getMessage() for r in caplog.records)


def test_a_check_over_non_finite_values_decides_nothing(
    kernel_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN row gives NaN on both sides (the same bits): such a check proves nothing, so no verdict is kept and the
    next call decides."""
    monkeypatch.setattr(
        engine_steps,
        "copied_log_probs",
        lambda logits, ids, temperature, runner: interpreted_v1.emulated_log_probs(logits, ids, temperature),
    )
    logits, ids = _logits(70, VOCABULARY, seed=22), _ids(70, VOCABULARY, seed=23)
    logits[0, 5] = math.nan
    assert engine_steps.read_by_kernel(logits, ids, 1.0, V1_RUNNER) is None
    assert kernel_on_cpu == [2 * engine_steps.CHECK_POSITIONS] and engine_steps._verdicts == {}
    logits[0, 5] = 0.0
    assert engine_steps.read_by_kernel(logits, ids, 1.0, V1_RUNNER) is not None
    assert engine_steps._verdicts == {(V1_RUNNER, logits.device, logits.dtype, VOCABULARY, False): True}


def test_v2_runner_never_reads_by_kernel(kernel_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """V2 reports its own Triton log-softmax: where the engine runs V2 (its kernels available) the V1 kernel (torch's
    order) is never called; V2's reader is asked instead (``v2_log_softmax``, tests/test_v2_log_softmax.py)."""
    asked: list[int] = []

    def v2_reader(logits, ids, temperature, rows=None):  # type: ignore[no-untyped-def]
        asked.append(ids.numel())
        raise RuntimeError("not V2's kernel here")

    monkeypatch.setattr(engine_steps, "uses_v2_kernel", lambda runner, device: runner == V2_RUNNER)
    monkeypatch.setattr(v2_log_softmax, "kernel_log_probs", v2_reader)
    logits, ids = _logits(80, VOCABULARY, seed=14), _ids(80, VOCABULARY, seed=15)
    assert engine_steps.read_by_kernel(logits, ids, 1.0, V2_RUNNER) is None
    assert kernel_on_cpu == [] and asked == [2 * engine_steps.CHECK_POSITIONS]


@pytest.mark.parametrize("trusted", [True, False])
def test_positions_read_trl_logits_by_kernel_up_to_each_length(
    kernel_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch, trusted: bool
) -> None:
    """``Positions.plain_log_probs`` on TRL 1.9.1's strided logits with completion lengths: trusted, one kernel call
    reads every scored position (and only those) and gives the kernel's values there, NaN after each length;
    not trusted, the float32 copy gives torch's bits. Both are the same log-probs within float32's last bits."""
    rows, width = 3, 40
    whole = _logits(rows * (width + 1), VOCABULARY, seed=16).reshape(rows, width + 1, VOCABULARY)
    view = whole[:, :-1, :]
    ids = _ids(rows * width, VOCABULARY, seed=17)
    lengths = [40, 25, 31]
    positions = Positions(torch.zeros(rows, width, 4), None, view, lengths)
    engine_steps._verdicts[(V1_RUNNER, view.device, view.dtype, VOCABULARY, True)] = trusted
    plain = positions.plain_log_probs(0.7, ids, V1_RUNNER)
    scored = positions.scored(ids.device)
    assert int(scored.sum()) == sum(lengths) and plain[~scored].isnan().all() and not plain[scored].isnan().any()
    flat = view.reshape(-1, VOCABULARY)[scored]
    copied = torch.log_softmax(flat.float() / 0.7, dim=-1).gather(1, ids[scored][:, None]).squeeze(1)
    if trusted:
        assert kernel_on_cpu == [sum(lengths)]
        assert torch.equal(plain[scored], interpreted_v1.emulated_log_probs(flat, ids[scored], 0.7))
    else:
        assert kernel_on_cpu == []
        assert torch.equal(plain[scored], copied)
    assert (plain[scored] - copied).abs().max() < 1e-5


_COMPILE = """
import json, sys
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from trl_vlm_fixes.patches.sampling_parity import v1_log_softmax as module
vocabulary, scaled, dtype = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
block = module.BLOCK
full = vocabulary // (4 * block)
names = ("out_ptr", "logits_ptr", "offsets_ptr", "ids_ptr", "temperature", "vocabulary")
signature = dict(zip(names, ("*fp32", "*" + dtype, "*i64", "*i64", "fp32", "i32")))
signature.update({name: "constexpr" for name in ("FULL", "TAIL", "SCALE", "BLOCK")})
constants = {"FULL": full, "TAIL": -(-(vocabulary - full * 4 * block) // block), "SCALE": scaled, "BLOCK": block}
source = ASTSource(fn=module._v1_log_prob_kernel, signature=signature, constexprs=constants)
try:
    ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
except RuntimeError as error:
    print(json.dumps({"unavailable": str(error)}))
    raise SystemExit(0)
print(json.dumps({"loads": "ld.global" in ptx, "ieee_division": "div.rn.f32" in ptx}))
"""


@pytest.mark.parametrize(("vocabulary", "scaled", "dtype"), [(248_320, True, "bf16"), (151_936, False, "fp32")])
def test_kernel_compiles_for_hopper(vocabulary: int, scaled: bool, dtype: str) -> None:
    """Triton's interpreter runs what its CUDA compiler refuses (a loop-carried name that changes shape did, in the
    first version): the kernel is compiled here for an H100 (sm_90: no GPU needed) at both vocabularies; its PTX
    divides by the temperature with IEEE division exactly where a temperature is applied. In a fresh process: a
    process that ran Triton's interpreter cannot compile afterwards (its language module stays patched)."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-c", _COMPILE, str(vocabulary), "1" if scaled else "0", dtype]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "unavailable" in report and "ptxas" in report["unavailable"]:
        pytest.skip(f"Triton cannot assemble for CUDA here: {report['unavailable']}")
    assert report == {"loads": True, "ieee_division": scaled}, report


def test_projected_positions_read_by_kernel(kernel_on_cpu: list[int]) -> None:
    """TRL 1.16's fused head keeps no logits: the hidden states are projected again in the head's dtype, up to each
    completion's end only (none of the padding after it), and the kernel reads those bf16 products (no float32 copy
    of them), one call per chunk of positions; NaN after each end, where TRL's own log-prob stays."""
    generator = torch.Generator().manual_seed(20)
    hidden = torch.randn(2, 12, 16, generator=generator).to(torch.bfloat16)  # [completions, positions, hidden]
    layer = OutputLayer((torch.randn(VOCABULARY, 16, generator=generator) * 2).to(torch.bfloat16))
    projected: list[int] = []
    products = layer.products
    layer.products = lambda states, dtype=None: projected.append(states.size(0)) or products(states, dtype)  # type: ignore[method-assign]
    positions = Positions(hidden, layer, lengths=[12, 5], dtype=torch.bfloat16)
    ids = _ids(24, VOCABULARY, seed=21)
    engine_steps._verdicts[(V1_RUNNER, hidden.device, hidden.dtype, VOCABULARY, False)] = True
    plain = positions.plain_log_probs(1.0, ids, V1_RUNNER)
    scored = positions.scored(ids.device)
    assert projected == [17] and kernel_on_cpu == [17] and int(scored.sum()) == 17
    assert plain[~scored].isnan().all()
    expected = interpreted_v1.emulated_log_probs(
        products(hidden.reshape(24, 16)[scored], torch.bfloat16), ids[scored], 1.0
    )
    assert torch.equal(plain[scored], expected)
