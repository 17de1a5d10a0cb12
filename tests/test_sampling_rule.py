"""sampling_parity's engine side: the top-k/top-p rule every vLLM step applies, on vLLM's own code on the CPU.

vLLM 0.25.1 on CUDA sends a step of 8 or more requests through its Triton kernel (exactly k tokens at a top-k tie) and
fewer through its sort path (every tied token kept). The engine stand-in takes those paths (vLLM's dispatch, its kernel
in Triton's interpreter); the plugin's engine wrapper makes every step take the kernel; ``vllm_rule.top_k_top_p`` is
that kernel for the trainer's logits. Logits lie on bf16's grid, as a bf16 model's do, so ties are common.
"""

from __future__ import annotations

import json
import logging
import math
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import module_from_source, run_python

import trl_vlm_fixes
from trl_vlm_fixes.patches.sampling_parity import engine_sampler, kernel_copy, vllm_rule

SAMPLER_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"
VOCAB = 300


@pytest.fixture
def kernel_copy_runs() -> None:
    """The tests of the GPU engine's paths need vLLM's kernel in the interpreter (vLLM 0.25.1's kernel file)."""
    pytest.importorskip("vllm")
    if reason := kernel_copy.why_no_copy():
        pytest.skip(f"no interpreter copy of vLLM's kernel: {reason}")


@pytest.fixture
def batch_threshold_dispatch(kernel_copy_runs: None) -> None:
    """The path-by-step-size bug exists only where vLLM's dispatch compares the step's size (0.25.1; not 0.31, whose
    kernel picks its top-p rule by the call's size instead: tests/test_kernel_copy_031.py)."""
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_module

    if not engine_sampler.compares_step_size(sampler_module.apply_top_k_top_p):
        pytest.skip("the installed vLLM sends every step through its kernel itself")


@pytest.fixture
def trainers_rollout() -> Any:
    """The steps of the test run as those of an engine whose trainer computes TRL's ratio (inside a GRPO rollout the
    fix serves, where ``VLLMGeneration.generate`` enters ``engine_sampler.routed``)."""
    with engine_sampler.routed():
        yield


def tie_row() -> torch.Tensor:
    """``[3, 1, 1, 1, -10, ...]``: top_k=2 cuts inside a three-way tie."""
    row = torch.full((VOCAB,), -10.0)
    row[0], row[1:4] = 3.0, 1.0
    return row


def bf16_rows(count: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(count, vocab, generator=generator) * 3).to(torch.bfloat16).float()


def stand_in_step(rows: torch.Tensor, params: Any) -> list[Any]:
    """One engine step of the stand-in over ``len(rows)`` requests (each reports its argmax token: always kept)."""
    from trl_vlm_fixes.selftest.vllm_sampler import Request, VllmSampler

    sampler = VllmSampler(vocab_size=rows.size(1), max_model_len=64)
    requests = [Request([1, 2, 3], params) for _ in rows]
    batch = sampler.new_batch(requests, tokenizer=None)
    scripted = {r.request_id: int(row.argmax()) for r, row in zip(requests, rows, strict=True)}
    sampled = batch.sample({r.request_id: row.clone() for r, row in zip(requests, rows, strict=True)}, scripted)
    return [sampled[r.request_id] for r in requests]


def rule_step(rows: torch.Tensor, top_k: int | None, top_p: float | None) -> list[tuple[int, float]]:
    """(kept tokens, argmax token's processed log-prob) per row under ``vllm_rule.top_k_top_p``."""
    k = None if top_k is None else torch.full((len(rows),), top_k, dtype=torch.int32)
    p = None if top_p is None else torch.full((len(rows),), top_p)
    logprobs = vllm_rule.top_k_top_p(rows.clone(), k, p).log_softmax(-1, dtype=torch.float32)
    return [
        (int((row > -math.inf).sum()), float(row[int(source.argmax())]))
        for row, source in zip(logprobs, rows, strict=True)
    ]


def sampler_globals() -> dict[str, Any]:
    import importlib

    scope = vars(importlib.import_module(SAMPLER_MODULE))
    return {
        name: scope.get(name, "<absent>") for name in ("HAS_TRITON", "apply_top_k_top_p_triton", "current_platform")
    }


# --- the stand-in takes the GPU engine's paths; the wrapper makes them one ----------------------------------------


@pytest.mark.parametrize("requests", [4, 8])
def test_a_tie_at_the_top_k_cut_is_kept_or_cut_by_the_steps_size_without_the_wrapper(
    requests: int, batch_threshold_dispatch: None, one_fix_off: Any
) -> None:
    """The bug: vLLM's processed log-prob of one token depends on how many requests shared its step."""
    from vllm import SamplingParams

    one_fix_off("sampling_parity")
    tokens = stand_in_step(tie_row().expand(requests, VOCAB), SamplingParams(top_k=2))
    sort_kept, kernel_kept = 4, 2  # the sort keeps the three tied 1s; the kernel exactly k
    expected_kept = kernel_kept if requests >= 8 else sort_kept
    assert {token.kept for token in tokens} == {expected_kept}
    expected = 3 - math.log(math.e**3 + (expected_kept - 1) * math.e)
    assert [token.logprob for token in tokens] == pytest.approx([expected] * requests, abs=1e-6)


@pytest.mark.parametrize("requests", [1, 4, 7, 8])
def test_with_the_wrapper_every_step_keeps_exactly_k_at_the_tie(
    requests: int, batch_threshold_dispatch: None, trainers_rollout: None
) -> None:
    from vllm import SamplingParams

    tokens = stand_in_step(tie_row().expand(requests, VOCAB), SamplingParams(top_k=2))
    assert {token.kept for token in tokens} == {2}
    assert [token.logprob for token in tokens] == pytest.approx([3 - math.log(math.e**3 + math.e)] * requests, abs=1e-6)


@pytest.mark.parametrize(("top_k", "top_p"), [(20, None), (None, 0.95), (20, 0.95), (64, 0.99)])
def test_a_small_step_gives_exactly_what_the_rule_gives_on_bf16_logits(
    top_k: int | None, top_p: float | None, batch_threshold_dispatch: None, trainers_rollout: None
) -> None:
    """With the wrapper, a step of 3 requests is the kernel's: the same kept set and log-prob as the trainer's rule,
    bit for bit; and the same rows in a step of 8 give the same (a row's result is its own)."""
    from vllm import SamplingParams

    params = SamplingParams(top_k=top_k or 0, top_p=top_p or 1.0)
    rows = bf16_rows(8)
    expected = rule_step(rows, top_k, top_p)
    small = [(token.kept, token.logprob) for token in stand_in_step(rows[:3], params)]
    large = [(token.kept, token.logprob) for token in stand_in_step(rows, params)]
    assert small == expected[:3]
    assert large == expected


def test_without_the_wrapper_a_small_steps_bf16_rows_take_the_sort_path(
    batch_threshold_dispatch: None, one_fix_off: Any
) -> None:
    """On bf16-grid rows the two paths disagree where the k-th value is tied: the small step is the sort's."""
    from vllm import SamplingParams
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    one_fix_off("sampling_parity")
    candidates = bf16_rows(64, seed=3)
    ordered = candidates.sort(dim=1, descending=True).values
    rows = candidates[ordered[:, 19] == ordered[:, 20]][:3]  # tied at the 20th value
    assert len(rows) == 3
    sort = apply_top_k_top_p_pytorch(rows.clone(), torch.full((3,), 20, dtype=torch.int32), None)
    small = [token.kept for token in stand_in_step(rows, SamplingParams(top_k=20))]
    assert small == (sort > -math.inf).sum(1).tolist()
    assert all(kept > 20 for kept in small)
    assert [kept for kept, _ in rule_step(rows, 20, None)] == [20, 20, 20]


KERNEL_LOGPROBS = {3 - math.log(math.e**3 + math.e), 1 - math.log(math.e**3 + math.e)}  # exactly k=2 kept
SORT_LOGPROBS = {3 - math.log(math.e**3 + 3 * math.e), 1 - math.log(math.e**3 + 3 * math.e)}  # the tie kept


@pytest.mark.parametrize(
    ("sequences", "fix", "expected"),
    [(8, "off", KERNEL_LOGPROBS), (4, "off", SORT_LOGPROBS), (4, "on", KERNEL_LOGPROBS)],
    ids=["8-off-kernel", "4-off-sort", "4-on-kernel"],
)
def test_the_stand_in_engine_samples_a_rollouts_sequences_in_one_step(
    sequences: int,
    fix: str,
    expected: set[float],
    tiny_text_model_dir: Path,
    batch_threshold_dispatch: None,
    one_fix_off: Any,
) -> None:
    """A GRPO rollout of 8 sequences is one engine step of 8 requests (vLLM's kernel), of 4 one of 4 (the sort,
    unless the wrapper is on): the processed log-probs the engine reports say which rule sampled every token."""
    from vllm import SamplingParams

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM

    if fix == "off":
        one_fix_off("sampling_parity")
    engine = StandInLLM(str(tiny_text_model_dir), logprobs_mode="processed_logprobs")
    row = torch.full((engine.served.vocab_size,), -10.0)
    row[0], row[1:4] = 3.0, 1.0
    engine.served.next_logits = lambda prompt, output, vision: row.clone()  # type: ignore[method-assign]
    params = SamplingParams(n=sequences, top_k=2, max_tokens=3, logprobs=0, ignore_eos=True, seed=0)
    with engine_sampler.routed():  # a trainer's rollout (the wrapper routes only there)
        (output,) = engine.generate([{"prompt_token_ids": [1, 2, 3]}], params)
    reported = [entry.logprob for c in output.outputs for step in c.logprobs or [] for entry in step.values()]
    assert len(reported) == 3 * sequences
    assert all(min(abs(value - e) for e in expected) < 1e-6 for value in reported), reported


def test_an_engine_no_trainers_ratio_reads_samples_as_vllm_built_it(
    tiny_text_model_dir: Path, batch_threshold_dispatch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper's scope: with the fix on, an engine sampling outside a rollout whose ratio the fix serves (another
    engine of the process, RLOO's, an inference script's) keeps vLLM's dispatch (4 requests: the sort keeps the tie);
    TRL's server engine (marked when TRL's server builds it, inherited by its workers) takes the kernel."""
    from vllm import SamplingParams

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM

    monkeypatch.delenv(engine_sampler.ROUTE_ENV, raising=False)
    engine = StandInLLM(str(tiny_text_model_dir), logprobs_mode="processed_logprobs")
    row = torch.full((engine.served.vocab_size,), -10.0)
    row[0], row[1:4] = 3.0, 1.0
    engine.served.next_logits = lambda prompt, output, vision: row.clone()  # type: ignore[method-assign]
    params = SamplingParams(n=4, top_k=2, max_tokens=3, logprobs=0, ignore_eos=True, seed=0)

    def reported() -> list[float]:
        (output,) = engine.generate([{"prompt_token_ids": [1, 2, 3]}], params)
        return [entry.logprob for c in output.outputs for step in c.logprobs or [] for entry in step.values()]

    assert all(min(abs(value - e) for e in SORT_LOGPROBS) < 1e-6 for value in reported())
    monkeypatch.setenv(engine_sampler.ROUTE_ENV, "1")  # what TRL's server build sets (server_engine_wrapper)
    assert all(min(abs(value - e) for e in KERNEL_LOGPROBS) < 1e-6 for value in reported())


def test_the_v2_runners_bound_names_are_wrapped_whatever_the_import_order() -> None:
    """vLLM's V2 model runner binds ``apply_top_k_top_p`` by name in its sampler modules: imported before the plugin
    (a fresh process), those names are still the plugin's wrapper, and status says so. (vLLM >= 0.31 sends every step
    to its kernel itself: the names are left as they are, `not-needed`.)"""
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_module

    current = sampler_module.apply_top_k_top_p
    needed = not engine_sampler.every_step_on_kernel(getattr(current, "__wrapped__", current))
    code = (
        "import json, vllm.v1.worker.gpu.sample.sampler as s, vllm.v1.worker.gpu.sample.states as t\n"
        "import trl_vlm_fixes, wrapt\n"
        "from trl_vlm_fixes.patches.sampling_parity import engine_sampler\n"
        "found = {m.__name__: isinstance(m.apply_top_k_top_p, wrapt.FunctionWrapper) for m in (s, t)}\n"
        "wrapper = engine_sampler.send_every_step_through_triton\n"
        "same = all(getattr(m.apply_top_k_top_p, '_self_wrapper', None) is wrapper for m in (s, t))\n"
        "targets = trl_vlm_fixes.REGISTRY._records['sampling_parity'].targets\n"
        "print(json.dumps({'found': found, 'same': same, 'targets': targets}))\n"
    )
    result = run_python(code, with_vllm=True)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(found == needed for found in report["found"].values()) and report["same"] == needed, report
    for module in engine_sampler.V2_MODULES:
        key = f"{module}:apply_top_k_top_p"
        assert report["targets"][key][0] == ("applied" if needed else "not-needed"), report["targets"]


def test_the_stand_in_dispatches_as_on_cuda_where_vllms_platform_is_a_cpu(
    batch_threshold_dispatch: None, one_fix_off: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU platform would send every size to the kernel: the stand-in shows it a platform that is not a CPU,
    so a step of 4 requests still takes the GPU engine's sort path."""
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_module
    from vllm import SamplingParams

    class CpuPlatform:
        def __init__(self, platform: Any) -> None:
            self.platform = platform

        def is_cpu(self) -> bool:
            return True

        def __getattr__(self, name: str) -> Any:
            return getattr(self.platform, name)

    one_fix_off("sampling_parity")
    monkeypatch.setattr(sampler_module, "current_platform", CpuPlatform(sampler_module.current_platform))
    tokens = stand_in_step(tie_row().expand(4, VOCAB), SamplingParams(top_k=2))
    assert {token.kept for token in tokens} == {4}
    assert isinstance(sampler_module.current_platform, CpuPlatform)


def test_the_stand_in_leaves_vllms_sampler_module_as_it_found_it(kernel_copy_runs: None) -> None:
    from vllm import SamplingParams

    from trl_vlm_fixes.selftest import vllm_sampler

    before = sampler_globals()
    stand_in_step(bf16_rows(2), SamplingParams(top_k=5))
    assert sampler_globals() == before
    with pytest.raises(RuntimeError, match="inside"), vllm_sampler.cuda_dispatch():
        assert sampler_globals()["HAS_TRITON"] is True
        raise RuntimeError("inside")
    assert sampler_globals() == before
    assert kernel_copy.interpreted_top_k_top_p(kernel_copy.CUDA_TILES)  # the interpreter mode did not stay on either
    import os

    import triton

    assert triton.knobs.runtime.interpret is False and "TRITON_INTERPRET" not in os.environ


# --- the rule is vLLM's own functions -----------------------------------------------------------------------------


@pytest.mark.parametrize(("top_k", "top_p"), [(20, None), (None, 0.95), (20, 0.95)])
def test_the_rule_is_the_kernel_the_stand_in_engine_runs(
    top_k: int | None, top_p: float | None, kernel_copy_runs: None
) -> None:
    import importlib

    from trl_vlm_fixes.selftest.vllm_sampler import cuda_dispatch

    rows = torch.cat([bf16_rows(5, seed=1), tie_row()[None]])
    k = None if top_k is None else torch.full((6,), top_k, dtype=torch.int32)
    p = None if top_p is None else torch.full((6,), top_p)
    with cuda_dispatch():  # the kernel the stand-in's step calls, as the wrapper applies it (vLLM 0.31: top-p alone
        # to its monolithic kernel; 0.25.1: the kernel itself)
        kernel = vars(importlib.import_module(SAMPLER_MODULE))["apply_top_k_top_p_triton"]
        engine = vllm_rule.apply_kernel(kernel, rows.clone(), k, p)
    assert vllm_rule.engine_path() == "triton"
    assert torch.equal(vllm_rule.top_k_top_p(rows.clone(), k, p), engine)


def test_the_interpreter_block_computes_what_triton_in_interpreter_mode_computes(
    kernel_copy_runs: None, tmp_path: Path
) -> None:
    """The scoped interpreter (the rest of the process sees Triton as it was) against Triton's documented mode,
    ``TRITON_INTERPRET=1`` before anything is imported, running vLLM's kernel file with only the cast the interpreter
    needs; CPU tiles on both sides (what vLLM picks for a CPU tensor)."""
    rows = torch.cat([bf16_rows(6, vocab=2000, seed=4), torch.nn.functional.pad(tie_row(), (0, 1700), value=-10)[None]])
    torch.save(rows, tmp_path / "rows.pt")
    program = f"""
        import os, sys, types, importlib.util
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, triton, triton.language as tl
        source = open(importlib.util.find_spec("{kernel_copy.KERNEL_MODULE}").origin).read()
        source = source.replace("row_id.to(tl.int64)", "tl.cast(row_id, tl.int64)")
        source = source.replace("row.to(tl.int64)", "tl.cast(row, tl.int64)")  # vLLM 0.31's split pipeline
        shim = types.ModuleType("vllm.triton_utils"); shim.triton, shim.tl = triton, tl
        import vllm.triton_utils
        try:  # vLLM 0.31's warm-up dispatchers, imported as vLLM imports them (before the shim)
            import vllm.model_executor.warmup.jit_warmup_triton_helper
        except ImportError:
            pass
        saved, sys.modules["vllm.triton_utils"] = sys.modules["vllm.triton_utils"], shim
        path = {str(tmp_path / "kernel.py")!r}
        open(path, "w").write(source)
        namespace = {{"__name__": "kernel", "__file__": path}}
        exec(compile(source, path, "exec"), namespace)
        sys.modules["vllm.triton_utils"] = saved
        namespace["num_compute_units"] = lambda device_id=None: 132
        rows = torch.load({str(tmp_path / "rows.pt")!r})
        out = {{}}
        for name, k, p in (("k", 20, None), ("p", None, 0.9), ("kp", 64, 0.99)):
            kk = None if k is None else torch.full((len(rows),), k, dtype=torch.int32)
            pp = None if p is None else torch.full((len(rows),), p)
            out[name] = namespace["apply_top_k_top_p_triton"](rows.clone(), kk, pp).tolist()
        print(json.dumps(out))
    """
    result = run_python(textwrap.dedent(program), with_vllm=True)
    reference = json.loads(result.stdout.strip().splitlines()[-1])
    ours = kernel_copy.interpreted_top_k_top_p(kernel_copy.CPU_TILES)
    for name, k, p in (("k", 20, None), ("p", None, 0.9), ("kp", 64, 0.99)):
        kk = None if k is None else torch.full((len(rows),), k, dtype=torch.int32)
        pp = None if p is None else torch.full((len(rows),), p)
        assert torch.equal(ours(rows.clone(), kk, pp), torch.tensor(reference[name])), name


@pytest.mark.parametrize(("tiles", "sizes"), [("cuda", (8192, 4096)), ("cpu", (256, 128))])
def test_the_copy_runs_with_the_tiles_vllm_picks_for_that_device(
    tiles: str, sizes: tuple[int, int], kernel_copy_runs: None
) -> None:
    kernel = kernel_copy.copy_namespace(tiles)["_topk_topp_kernel"]
    seen: list[tuple[int, int]] = []

    def hook(*args: Any, **kwargs: Any) -> None:
        seen.append((kwargs["BLOCK_SIZE"], kwargs["BLOCK_SIZE_TRUNC"]))

    kernel.add_pre_run_hook(hook)
    try:
        kernel_copy.interpreted_top_k_top_p(tiles)(bf16_rows(1), torch.tensor([5], dtype=torch.int32), None)
    finally:
        kernel.pre_run_hooks.remove(hook)
    assert seen == [sizes]


def test_where_no_kernel_copy_runs_the_rule_and_the_stand_in_take_vllms_sort_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM whose kernel the copy was not proven on (any file but 0.25.1's and 0.31.0's): both sides take the sort
    path, and the reason is in the rule's line."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    if kernel_copy.why_no_copy() is None:  # the proven kernel is installed: stand another file in for it
        monkeypatch.setattr(kernel_copy, "why_no_copy", lambda: "a kernel file the copy was not proven on")
    if vllm_rule._vllm_has_triton():
        pytest.skip("vLLM has Triton here: the rule is its kernel")
    rows = torch.cat([tie_row().expand(3, VOCAB), bf16_rows(3)])
    k = torch.full((6,), 2, dtype=torch.int32)
    assert vllm_rule.engine_path() == "pytorch"
    assert kernel_copy.why_no_copy() in vllm_rule.describe()  # type: ignore[operator]
    assert torch.equal(vllm_rule.top_k_top_p(rows.clone(), k, None), apply_top_k_top_p_pytorch(rows.clone(), k, None))
    assert [token.kept for token in stand_in_step(tie_row().expand(8, VOCAB), SamplingParams(top_k=2))] == [4] * 8


# --- the engine wrapper's declaration -----------------------------------------------------------------------------

DISPATCH_0_25 = """
    def apply_top_k_top_p(logits, k, p):
        if p is None and k is None:
            return logits
        if current_platform.is_cpu():
            if HAS_TRITON:
                return apply_top_k_top_p_triton(logits, k, p)
            return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)
        if HAS_TRITON and logits.shape[0] >= 8:
            return apply_top_k_top_p_triton(logits, k, p)
        return apply_top_k_top_p_pytorch(logits, k, p)
"""
DISPATCH_0_31 = """
    def apply_top_k_top_p(logits, k, p):
        if p is None and k is None:
            return logits
        if HAS_TRITON:
            return apply_top_k_top_p_triton(logits, k, p)
        is_cpu = current_platform.is_cpu()
        return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=is_cpu)
"""
SPLIT_KERNEL_0_31 = """
    _SPLIT_MAX_BATCH = 64

    def apply_top_k_top_p_triton(logits, k, p):
        return logits
"""
DISPATCH_OTHER = """
    def apply_top_k_top_p(logits, k, p):
        return flashinfer_top_k_top_p(logits, k, p)
"""


@pytest.mark.parametrize(
    ("source", "problem", "not_needed"),
    [
        (DISPATCH_0_25, None, None),
        (DISPATCH_0_31, None, "whatever its size"),
        (DISPATCH_0_31 + SPLIT_KERNEL_0_31, None, None),
        (DISPATCH_OTHER, "no longer", None),
    ],
    ids=["0.25", "no batch-size test", "0.31 (its kernel splits small calls)", "other"],
)
def test_the_wrapper_reads_which_dispatch_the_installed_vllm_has(
    source: str, problem: str | None, not_needed: str | None, tmp_path: Path
) -> None:
    """vLLM 0.25.1 picks its path by the step's size; a dispatch without that test needs no wrapper unless its kernel
    picks its top-p rule by the call's size (0.31's ``_SPLIT_MAX_BATCH``): the wrapper is needed there."""
    with module_from_source(tmp_path, "dispatch_shape", textwrap.dedent(source)) as module:
        found_problem = engine_sampler.dispatch_problem(module.apply_top_k_top_p)
        found_not_needed = engine_sampler.every_step_on_kernel(module.apply_top_k_top_p)
    assert (found_problem is None) == (problem is None) and (problem or "") in (found_problem or "")
    assert (found_not_needed is None) == (not_needed is None) and (not_needed or "") in (found_not_needed or "")


def test_the_installed_vllms_dispatch_gets_the_state_its_source_calls_for() -> None:
    pytest.importorskip("vllm")
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_module

    original = getattr(sampler_module.apply_top_k_top_p, "__wrapped__", sampler_module.apply_top_k_top_p)
    detail = trl_vlm_fixes.status()["patches"]["sampling_parity"]["detail"]
    if engine_sampler.every_step_on_kernel(original):
        assert "apply_top_k_top_p: vLLM's apply_top_k_top_p sends every step through" in detail
        assert sampler_module.apply_top_k_top_p is original
    else:
        assert "apply_top_k_top_p wrapped" in detail
        assert sampler_module.apply_top_k_top_p is not original


def test_without_triton_the_wrapper_calls_vllms_own_dispatch_and_says_so_once(
    caplog: pytest.LogCaptureFixture, trainers_rollout: None
) -> None:
    """No GPU, no stand-in: vLLM has no Triton, so the wrapper leaves the step to vLLM (its sort path)."""
    pytest.importorskip("vllm")
    import vllm.v1.sample.ops.topk_topp_sampler as sampler_module

    if sampler_module.HAS_TRITON or not hasattr(sampler_module.apply_top_k_top_p, "__wrapped__"):
        pytest.skip("vLLM has Triton here, or the wrapper is not needed on this vLLM")
    rows = tie_row().expand(2, VOCAB).clone()
    k = torch.full((2,), 2, dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="trl_vlm_fixes"):
        first = sampler_module.apply_top_k_top_p(rows.clone(), k, None)
        sampler_module.apply_top_k_top_p(rows.clone(), k, None)
    assert (first > -math.inf).sum(1).tolist() == [4, 4]
    lines = [r.getMessage() for r in caplog.records if "engine sampler left as vLLM's" in r.getMessage()]
    assert len(lines) == 1 and "no Triton" in lines[0]


@pytest.fixture(autouse=True)
def _said_afresh() -> Iterator[None]:
    from trl_vlm_fixes import log_once

    log_once.forget()
    yield
    assert trl_vlm_fixes.status()  # the plugin still answers after every test


def test_a_top_p_cut_whose_rule_depends_on_the_steps_size_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.31's top-p without top-k: steps of at most 64 requests take a split-row pipeline on CUDA, larger calls
    the monolithic kernel. With the plugin's engine wrapper on vLLM's dispatch every step takes the monolithic kernel,
    as the trainer does: nothing is named. Without it the fix names it (and steps aside) exactly where the installed
    kernel has that split, for CUDA tensors and for CPU tensors where the interpreted copy (CUDA dispatch) is the
    rule, and only without an active top-k."""
    import inspect

    import vllm.v1.sample.ops.topk_topp_sampler as sampler_module
    import vllm.v1.sample.ops.topk_topp_triton as kernel

    split = "use_split" in inspect.getsource(kernel.apply_top_k_top_p_triton)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert vllm_rule.size_dependent_top_p(0, 0.95, cuda, VOCAB) is None  # the wrapper is on (or there is no split)
    assert vllm_rule.size_dependent_top_p(0, 0.95, cpu, VOCAB) is None
    current = sampler_module.apply_top_k_top_p
    monkeypatch.setattr(sampler_module, "apply_top_k_top_p", getattr(current, "__wrapped__", current))
    reason = vllm_rule.size_dependent_top_p(0, 0.95, cuda, VOCAB)
    assert (reason is not None) == split, reason
    assert vllm_rule.size_dependent_top_p(20, 0.95, cuda, VOCAB) is None  # an active top-k: the monolithic kernel
    # a top-k of the whole vocabulary is no top-k (InputBatch passes none): the split pipeline again
    assert (vllm_rule.size_dependent_top_p(VOCAB, 0.95, cuda, VOCAB) is not None) == split
    interpreted_split = split and kernel_copy.why_no_copy() is None
    assert (vllm_rule.size_dependent_top_p(0, 0.95, cpu, VOCAB) is not None) == interpreted_split
    assert vllm_rule.size_dependent_top_p(0, 1.0, cuda, VOCAB) is None


def test_the_scoring_pass_steps_aside_where_the_top_p_rule_depends_on_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The path: where ``size_dependent_top_p`` gives a reason (vLLM 0.31 on CUDA; stood in here on the CPU), GRPO's
    scoring pass keeps TRL's ratio and one WARNING says why; elsewhere the same rollout's ratio is the fix's (1)."""
    import trl.generation.vllm_generation as vllm_generation
    from transformers import AutoProcessor

    from trl_vlm_fixes.selftest.engine_standin import StandInLLM
    from trl_vlm_fixes.selftest.fixtures import build_trainer, text_dataset
    from trl_vlm_fixes.selftest.tiny_model import build_tiny_qwen35_vlm

    monkeypatch.setattr(vllm_generation, "LLM", StandInLLM, raising=False)
    model_dir = build_tiny_qwen35_vlm(tmp_path / "model", sharpness=20.0)
    processor = AutoProcessor.from_pretrained(model_dir)

    def ratio(out: str) -> float:
        trainer = build_trainer(
            model_dir,
            processor,
            str(tmp_path / out),
            use_vllm=True,
            vllm_mode="colocate",
            max_steps=1,
            max_completion_length=16,
            generation_kwargs={"seed": 0, "top_p": 0.8},
            dataset=text_dataset(),
        )
        trainer.train()
        return next(log for log in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in log)[
            "sampling/importance_sampling_ratio/mean"
        ]

    assert abs(ratio("exact") - 1.0) < 1e-5
    monkeypatch.setattr(vllm_rule, "size_dependent_top_p", lambda k, p, device, vocabulary: "a size-dependent rule")
    with caplog.at_level(logging.WARNING, logger="trl_vlm_fixes"):
        stepped_aside = ratio("aside")
    assert stepped_aside < 0.9  # TRL's ratio: the cut's share is in it
    assert any("a size-dependent rule" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    ("argv", "server"),
    [
        (["/usr/bin/python3", "/venv/bin/trl", "vllm-serve", "--model", "m"], True),
        (["python", "-m", "trl.scripts.vllm_serve", "--model", "m"], True),
        (["python", "/venv/lib/python3.11/site-packages/trl/scripts/vllm_serve.py"], True),
        (["python", "/venv/bin/trl", "grpo", "--config", "grpo.yaml"], False),
        (["python", "train.py", "vllm-serve"], False),
        (["python", "-m", "vllm.entrypoints.cli.main", "serve"], False),
    ],
)
def test_trls_server_process_is_known_by_its_command_line(argv: list[str], server: bool) -> None:
    """The engine of TRL's server is routed (its only clients are TRL's trainers): the process is known by the command
    line the interpreter was started with; a trainer, a user's script, vLLM's own server are not TRL's server. (The
    whole path, a real `trl vllm-serve` under the launcher whose engine workers inherit the mark:
    tests/test_launcher.py::test_trl_vllm_serve_engine_gets_the_engine_arguments_however_it_is_started.)"""
    assert engine_sampler.started_as_trl_server(argv) is server
