"""The engine's reported log-prob read from bf16 logits by the fix's kernels (``patches/sampling_parity/
v1_log_softmax.py``, ``v2_log_softmax.py``) against the engine's own function on the float32 copy: bits and time.

    python benchmarks/gpu/v1_log_softmax.py [--positions 16384] [--vocabulary 151936,248320] [--out FILE]
    python benchmarks/gpu/v1_log_softmax.py --dry-run   # the CPU, Triton's interpreter, small shapes

Needs torch, Triton and transformers (the GPU machine's torch 2.11.0 is vLLM 0.25.1's pin); vLLM's V2 kernels from
vLLM where it imports, else from copies of its ``gumbel.py`` and ``logprob.py`` in ``--v2-source`` (the GPU machine
has no vLLM); TRL is not needed. V1: for each vocabulary, spread and temperature, the fix's torch path (chunks of
``CHUNK_ELEMENTS / (2 * vocabulary)`` positions: a float32 copy, the engine's temperature division, ``log_softmax``, a
gather) over ``--positions`` positions, the kernel on the bf16 logits, the positions whose float32 bits differ (for a
token drawn from each row, and for each row's likeliest token, whose log-prob near 0 shows the row sum's last bits),
and each one's time (mean of 3 after a warm-up). The same order written in torch operations (``emulated_log_probs``) on
the first 64 rows tells whether torch's kernel sums in that order. Also: torch's function over chunks small enough to
stay in the GPU's L2 cache (another way to the same bits), and the kernel's first-call compile time. V2: the fix's
copy path (V2's temperature and log-prob kernels) against its kernel, V2's own kernel handed bf16, and the fix's
decision (``engine_steps.read_by_kernel``). Then both beside a 2B-class scoring pass.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
CHUNK_ELEMENTS = 1 << 26  # processed.CHUNK_ELEMENTS: the fix's chunk holds two float32 tensors of this many / 2
SPREADS = {"peaked": 4.5, "flat": 1.0, "dominant": 2.0}  # std of the logits; dominant: one token 25 above the rest


def load_module() -> Any:
    """v1_log_softmax from its file (its package's import would patch TRL)."""
    path = ROOT / "trl_vlm_fixes" / "patches" / "sampling_parity" / "v1_log_softmax.py"
    spec = importlib.util.spec_from_file_location("v1_log_softmax", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def logits_of(positions: int, vocabulary: int, spread: str, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    values = torch.randn(positions, vocabulary, generator=generator, device=device) * SPREADS[spread]
    if spread == "dominant":
        top = torch.randint(0, vocabulary, (positions, 1), generator=generator, device=device)
        values.scatter_add_(1, top, torch.full_like(top, 25, dtype=values.dtype))
    return values.to(torch.bfloat16)


def sampled(logits: torch.Tensor, temperature: float, seed: int) -> torch.Tensor:
    """A token drawn from each row at ``temperature`` (the completions' tokens: log-probs of a few nats)."""
    generator = torch.Generator(device=logits.device).manual_seed(seed)
    parts = [
        torch.multinomial(torch.softmax(part.float() / temperature, -1), 1, generator=generator).squeeze(1)
        for part in logits.split(1024)
    ]
    return torch.cat(parts)


def torch_path(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The fix's torch path (``Positions.plain_log_probs``), chunk by chunk."""
    step = max(1, CHUNK_ELEMENTS // (2 * logits.size(1)))
    parts = []
    for part, chosen in zip(logits.split(step), ids.split(step), strict=True):
        values = part.to(torch.float32, copy=True)
        if temperature != 1.0:  # Sampler.apply_temperature: division by the requests' float32 temperatures
            values.div_(torch.full((values.size(0), 1), temperature, dtype=torch.float32, device=values.device))
        parts.append(torch.log_softmax(values, dim=-1).gather(1, chosen[:, None]).squeeze(1))
    return torch.cat(parts)


def l2_chunks(rows: int) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """torch's function (temperature 1) over ``rows`` positions at a time into two reused buffers."""

    def run(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        source = torch.empty(rows, logits.size(1), dtype=torch.float32, device=logits.device)
        output = torch.empty_like(source)
        parts = []
        for part, chosen in zip(logits.split(rows), ids.split(rows), strict=True):
            count = part.size(0)
            source[:count].copy_(part)
            torch.ops.aten._log_softmax.out(source[:count], -1, False, out=output[:count])
            parts.append(output[:count].gather(1, chosen[:, None]).squeeze(1))
        return torch.cat(parts)

    return run


def timed_ms(function: Callable[[], torch.Tensor], device: torch.device) -> tuple[torch.Tensor, float]:
    result = function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, (time.perf_counter() - started) / 3 * 1e3


def differing(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, Any]:
    return {
        "positions": int(ours.numel()),
        "differing": int((ours != theirs).sum()),
        "max_abs": float((ours.double() - theirs.double()).abs().max()),
    }


def record(
    kernel: Callable[..., torch.Tensor],
    emulated: Callable[..., torch.Tensor],
    positions: int,
    vocabulary: int,
    spread: str,
    temperature: float,
    device: torch.device,
) -> dict[str, Any]:
    logits = logits_of(positions, vocabulary, spread, device, seed=vocabulary % 1000 + len(spread))
    ids = sampled(logits, temperature, seed=7)
    reference, torch_ms = timed_ms(lambda: torch_path(logits, ids, temperature), device)
    fast, kernel_ms = timed_ms(lambda: kernel(logits, ids, temperature), device)
    likeliest = logits.argmax(dim=-1)  # a log-prob near 0, where float32 resolves the row sum's last bits
    head = min(64, positions)
    result = {
        "vocabulary": vocabulary,
        "spread": spread,
        "temperature": temperature,
        "kernel_vs_torch": differing(fast, reference),
        "kernel_vs_torch_likeliest": differing(
            kernel(logits, likeliest, temperature), torch_path(logits, likeliest, temperature)
        ),
        "emulated_vs_torch_first_rows_likeliest": differing(
            emulated(logits[:head], likeliest[:head], temperature),
            torch_path(logits[:head], likeliest[:head], temperature),
        ),
        "float32_input_vs_torch": differing(kernel(logits[:head].float(), ids[:head], temperature), reference[:head]),
        "torch_path_ms": torch_ms,
        "kernel_ms": kernel_ms,
    }
    if temperature == 1.0:
        for rows in (32, 64):
            chunked, ms = timed_ms(lambda rows=rows: l2_chunks(rows)(logits, ids, 1.0), device)
            result[f"l2_chunks_{rows}"] = {"ms": ms, **differing(chunked, reference)}
    return result


V2_FUNCTIONS = {  # what the V2 record runs of vLLM's sampling modules (vllm/v1/worker/gpu/sample/)
    "gumbel": ("_temperature_kernel", "apply_temperature"),
    "logprob": ("_MAX_TOPK_BLOCK", "_topk_log_softmax_kernel", "compute_token_logprobs"),
}


def v2_modules(source: str | None) -> dict[str, Any] | None:
    """vLLM V2's temperature and log-prob kernels, compiled: from vLLM where it imports with Triton, else from copies
    of its two files in ``source`` (the GPU machine has no vLLM): the functions named in ``V2_FUNCTIONS``, taken out
    of each file whole (``ast``), with the real triton."""
    import ast
    import tempfile
    import types

    try:
        from vllm.triton_utils import HAS_TRITON

        if HAS_TRITON:
            return {name: importlib.import_module(f"vllm.v1.worker.gpu.sample.{name}") for name in V2_FUNCTIONS}
    except ImportError:
        pass
    if source is None:
        return None
    modules: dict[str, Any] = {}
    for name, wanted in V2_FUNCTIONS.items():
        text = (Path(source) / f"{name}.py").read_text()
        tree = ast.parse(text)
        nodes = [
            node
            for node in tree.body
            if getattr(node, "name", None) in wanted
            or (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in wanted)
        ]
        if len(nodes) != len(wanted):
            raise RuntimeError(f"{name}.py: found {len(nodes)} of {wanted}")
        parts = [
            "".join(f"@{ast.get_source_segment(text, d)}\n" for d in getattr(node, "decorator_list", []))
            + str(ast.get_source_segment(text, node))
            for node in nodes
        ]
        body = "\n\n".join(parts)
        path = Path(tempfile.mkdtemp()) / f"vllm_v2_{name}.py"
        path.write_text(f"import torch\nimport triton\nimport triton.language as tl\n\n{body}\n")
        spec = importlib.util.spec_from_file_location(f"vllm_v2_{name}", path)
        assert spec is not None and spec.loader is not None
        module = types.ModuleType(spec.name)
        module.__file__ = str(path)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules[name] = module
    return modules


def v2_functions(source: str | None, device: torch.device) -> SimpleNamespace | None:
    """The V2 record's functions: ``read`` (the fix's kernel on bf16 logits), ``engine`` (what V2 reports: a float32
    copy, its temperature kernel, ``compute_token_logprobs``), ``own`` (V2's kernel handed bf16 logits), ``gate`` (the
    fix's decision, ``engine_steps.read_by_kernel``: on a GPU only).
    Compiled on a GPU (the fix's copy path, ``engine_steps.copied_log_probs``, running vLLM's kernels); interpreted
    on the CPU (the dry run)."""
    from trl_vlm_fixes.patches.sampling_parity import engine_steps, kernel_copy, v2_log_softmax
    from trl_vlm_fixes.patches.sampling_parity.distribution import V2_RUNNER

    if device.type != "cuda":
        from trl_vlm_fixes.selftest import v2_kernels

        engine = v2_kernels.Engine(device)

        def interpreted_own(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            with kernel_copy.interpreting():
                return engine.kernels.compute_token_logprobs(logits, ids.unsqueeze(1)).squeeze(1)

        return SimpleNamespace(
            gate=None,
            read=v2_kernels.interpreted_reader(),
            engine=lambda logits, ids, t: engine.logprobs(engine.temperature(logits, t), ids.unsqueeze(1)),
            own=interpreted_own,
        )
    modules = v2_modules(source)
    if modules is None:
        return None
    engine_steps._v2_module = lambda name: modules.get(name)  # vLLM's kernels where the fix looks for them
    kernel = modules["logprob"].compute_token_logprobs
    return SimpleNamespace(
        gate=lambda logits, ids, t: engine_steps.read_by_kernel(logits, ids, t, V2_RUNNER),
        read=v2_log_softmax.kernel_log_probs,
        engine=lambda logits, ids, t: engine_steps.copied_log_probs(logits, ids, t, V2_RUNNER),
        own=lambda logits, ids: kernel(logits, ids.unsqueeze(1)).squeeze(1),
    )


def v2_record(
    v2: SimpleNamespace, positions: int, vocabulary: int, temperature: float, device: torch.device
) -> dict[str, Any]:
    """V2's read: the fix's copy path (a chunk at a time, as ``Positions.plain_log_probs``) against the fix's kernel
    on the bf16 logits, and against V2's own kernel handed the bf16 logits (Triton loads them in another layout: is
    its order another?)."""
    logits = logits_of(positions, vocabulary, "peaked", device, seed=vocabulary % 1000 + 11)
    ids = sampled(logits, temperature, seed=8)
    step = max(1, CHUNK_ELEMENTS // (2 * vocabulary))

    def copy_path(chosen: torch.Tensor) -> torch.Tensor:
        pairs = zip(logits.split(step), chosen.split(step), strict=True)
        return torch.cat([v2.engine(part, token, temperature) for part, token in pairs])

    reference, copy_ms = timed_ms(lambda: copy_path(ids), device)
    fast, kernel_ms = timed_ms(lambda: v2.read(logits, ids, temperature), device)
    likeliest = logits.argmax(dim=-1)  # a log-prob near 0, where float32 resolves the row sum's last bits
    likeliest_reference = copy_path(likeliest)
    result: dict[str, Any] = {
        "section": "V2",
        "vocabulary": vocabulary,
        "temperature": temperature,
        "kernel_vs_v2": differing(fast, reference),
        "kernel_vs_v2_likeliest": differing(v2.read(logits, likeliest, temperature), likeliest_reference),
        "copy_ms": copy_ms,
        "kernel_ms": kernel_ms,
    }
    if v2.gate is not None:  # the fix's own decision at this temperature (a fresh check), and what it then reads
        from trl_vlm_fixes.patches.sampling_parity import engine_steps
        from trl_vlm_fixes.patches.sampling_parity.distribution import V2_RUNNER

        engine_steps._verdicts.pop((V2_RUNNER, logits.device, logits.dtype, vocabulary, temperature != 1.0), None)
        gated = v2.gate(logits, ids, temperature)
        result["gate_trusted"] = gated is not None
        if gated is not None:
            result["gated_vs_v2"] = differing(gated, reference)
    if temperature == 1.0:  # V2's own kernel on bf16 (no temperature step there): the load's layout alone
        result["v2_own_kernel_on_bf16_vs_v2_likeliest"] = differing(v2.own(logits, likeliest), likeliest_reference)
    return result


def trl_selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """TRL 1.9.1's ``selective_log_softmax`` on bf16 logits (its non-float32 branch: a log-softmax per row), used
    where TRL is not installed (the dry run checks it against TRL's own)."""
    pairs = zip(logits, index, strict=True)
    return torch.stack([torch.log_softmax(row, dim=-1).gather(-1, labels[:, None]) for row, labels in pairs]).squeeze(
        -1
    )


def scoring_record(
    vocabulary: int, rows: int, completion: int, hidden: int, layers: int, device: torch.device, runners: list[str]
) -> dict[str, Any]:
    """The fix's plain log-prob (``Positions.plain_log_probs``, TRL 1.9.1's logits read, temperature 1, each runner)
    beside the no-gradient scoring pass it joins (a random Qwen3.5 text stack, bf16: its forward and TRL's
    ``selective_log_softmax``, as ``benchmarks/sampling_parity_cost.py`` times it): with the kernel (the gate's
    verdict as it falls) and with the float32 copy (the gate told no), bits compared. Without flash-linear-attention
    (not on the GPU machine) transformers runs its Gated-DeltaNet in PyTorch: the pass is slower than a tuned one, so
    the shares are lower bounds of the share in a tuned pass (as in docs/gpu-results.md#sampling-parity-cost)."""
    sys.path.insert(0, str(ROOT))
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from trl_vlm_fixes.patches.sampling_parity import engine_steps, processed
    from trl_vlm_fixes.selftest.tiny_model import qwen35_layer_stack

    try:
        from trl.trainer.utils import selective_log_softmax
    except ImportError:
        selective_log_softmax = trl_selective_log_softmax
    torch.manual_seed(0)
    heads = max(2, hidden // 128)
    config = Qwen3_5TextConfig(
        vocab_size=vocabulary,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        tie_word_embeddings=False,
        **qwen35_layer_stack(layers, heads, head_dim=128, value_heads=heads),
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # built where it runs, in bf16: no float32 copy on the host first
            model = Qwen3_5ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits of a few units: a peaked distribution, as a trained model's
    prompt = 256 if device.type == "cuda" else 8
    ids = torch.randint(0, vocabulary, (rows, prompt + completion), device=device)
    completion_ids = ids[:, -completion:]

    def scoring_pass() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = model(input_ids=ids, logits_to_keep=completion + 1, use_cache=False).logits[:, :-1, :]
            return logits, selective_log_softmax(logits, completion_ids)

    (logits, _), pass_ms = timed_ms(scoring_pass, device)
    positions = processed.Positions(torch.zeros(rows, completion, 1, device=device), None, logits, [completion] * rows)
    flat_ids = completion_ids.reshape(-1)
    result: dict[str, Any] = {
        "section": "scoring pass",
        "vocabulary": vocabulary,
        "positions": f"{rows} x {completion}",
        "model": f"hidden {hidden}, {layers} layers",
        "scoring_pass_ms": pass_ms,
    }
    for runner in runners:
        key = (runner, logits.device, logits.dtype, vocabulary, False)
        engine_steps._verdicts.pop(key, None)
        fast, fast_ms = timed_ms(lambda runner=runner: positions.plain_log_probs(1.0, flat_ids, runner), device)
        trusted = engine_steps._verdicts.get(key)
        engine_steps._verdicts[key] = False  # the float32 copy, as without the kernel
        copied, copied_ms = timed_ms(lambda runner=runner: positions.plain_log_probs(1.0, flat_ids, runner), device)
        engine_steps._verdicts.pop(key, None)
        result[runner] = {
            "kernel_trusted": trusted,
            "fix_vs_copy": differing(fast, copied),
            "fix_ms": fast_ms,
            "copy_ms": copied_ms,
            "fix_share": fast_ms / pass_ms,
            "copy_share": copied_ms / pass_ms,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=16384, help="16 x 1,024")
    parser.add_argument("--vocabulary", default="151936,248320")
    parser.add_argument("--temperatures", default="1.0,0.7")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, small shapes")
    parser.add_argument("--scoring", default="1024,2048", help="completion lengths of the scoring-pass section")
    parser.add_argument("--rows", type=int, default=16, help="scoring-pass section: completions in one model call")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--out", default="v1_log_softmax.json")
    parser.add_argument(
        "--v2-source", default=str(ROOT / ".gpu" / "vllm_v2"), help="copies of V2's gumbel.py and logprob.py (no vLLM)"
    )
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    module = load_module()
    sys.path.insert(0, str(ROOT))
    from trl_vlm_fixes.patches.sampling_parity.distribution import V1_RUNNER, V2_RUNNER

    if args.dry_run:
        from trl_vlm_fixes.selftest import interpreted_v1

        kernel, emulated = interpreted_v1.kernel_log_probs, interpreted_v1.emulated_log_probs
        vocabularies, positions = [12800], 4
    else:
        kernel, emulated = module.kernel_log_probs, module.emulated_log_probs
        vocabularies, positions = [int(v) for v in args.vocabulary.split(",")], args.positions
    report: dict[str, Any] = {
        "device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": getattr(module.triton, "__version__", None),
        "results": [],
    }
    started = time.perf_counter()
    warm = logits_of(2, vocabularies[0], "peaked", device, seed=0)
    kernel(warm, torch.zeros(2, dtype=torch.int64, device=device), 1.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    report["first_call_s"] = time.perf_counter() - started
    temperatures = [float(t) for t in args.temperatures.split(",")]

    def save(entry: dict[str, Any]) -> None:  # after each record: a call cut at its limit keeps what it measured
        report["results"].append(entry)
        print(json.dumps(entry), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2))

    def kernel_records(spreads: list[str]) -> None:
        for vocabulary in vocabularies:
            for spread in spreads:
                for temperature in temperatures:
                    save(record(kernel, emulated, positions, vocabulary, spread, temperature, device))

    kernel_records(["peaked"])  # the most telling first: the device may be taken back
    if args.dry_run:
        check_trl_function(device)
    v2 = v2_functions(args.v2_source, device)
    report["v2"] = "vLLM's kernels" if v2 is not None else f"not run: no vLLM and no copies in {args.v2_source}"
    for vocabulary in vocabularies if v2 is not None else []:
        for temperature in temperatures:
            try:
                save(v2_record(v2, positions, vocabulary, temperature, device))
            except Exception as error:  # noqa: BLE001 - recorded; the other records still run
                save({"section": "V2", "vocabulary": vocabulary, "error": repr(error)[:500]})
    runners = [V1_RUNNER] + ([V2_RUNNER] if v2 is not None else [])
    for completion in (int(c) for c in args.scoring.split(",") if c):
        for vocabulary in vocabularies:
            shape = (2, 8, 64, 4) if args.dry_run else (args.rows, completion, args.hidden, args.layers)
            try:
                save(scoring_record(vocabulary, *shape, device, runners))
            except Exception as error:  # noqa: BLE001 - recorded; the other records still run
                save({"section": "scoring pass", "vocabulary": vocabulary, "error": repr(error)[:500]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    kernel_records([spread for spread in SPREADS if spread != "peaked"])
    Path(args.out).write_text(json.dumps(report, indent=2))


def check_trl_function(device: torch.device) -> None:
    """The stand-in for TRL's ``selective_log_softmax`` gives TRL's own bits (where TRL is installed)."""
    try:
        from trl.trainer.utils import selective_log_softmax
    except ImportError:
        return
    logits = logits_of(6, 12800, "peaked", device, seed=3).reshape(2, 3, 12800)
    index = torch.randint(0, 12800, (2, 3), device=device)
    assert torch.equal(trl_selective_log_softmax(logits, index), selective_log_softmax(logits, index))


if __name__ == "__main__":
    main()
