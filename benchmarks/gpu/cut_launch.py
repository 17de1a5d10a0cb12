"""The cuts' cost on the trainer's side: vLLM's top-k/top-p kernel as vLLM launches it against the fix's wide launch
(``patches/sampling_parity/wide_launch.py``: one program per row, at most ``PROGRAMS_PER_UNIT`` per SM), bits and time.

    python benchmarks/gpu/cut_launch.py [--positions 16384] [--vocabulary 151936,248320] [--out FILE]
    python benchmarks/gpu/cut_launch.py --dry-run   # the CPU, Triton's interpreter, small shapes

Needs torch and Triton; vLLM's kernel file from vLLM where it imports, else a copy of vLLM 0.25.1's
``vllm/v1/sample/ops/topk_topp_triton.py`` in ``--kernel-source`` (the GPU machine has no vLLM; the copy must have
0.25.1's sha256). For each vocabulary, spread and setting, the fix's cut path over ``--positions`` positions of bf16
logits, a chunk at a time (``CHUNK_ELEMENTS / vocabulary`` positions, as ``processed`` chunks them): the time of the
float32 copy and of the log-softmax with its gather (mean of 2 after a warm-up), and of the kernel (CUDA events around
each launch, the median of 5 sweeps; vLLM's launch timed before and after the wide ones), launched as vLLM launches
it (``min(SMs, rows)`` programs) and wide with 1 (vLLM's grid: a control), 2, 4 and 8 programs per SM
(``VARIANTS``), 4 and 8 also with chunks of twice the rows; the positions whose masked logits differ from vLLM's
launch in any bit, and those whose processed log-prob does. The logits are synthetic (Gaussian at two spreads): which
branches the kernel's search takes, and so its time, depends on them; a trained model's may take others.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
CHUNK_ELEMENTS = 1 << 26  # processed.CHUNK_ELEMENTS: a cut's chunk holds this many float32 logits
SPREADS = {"peaked": 4.5, "flat": 1.0}  # std of the logits
SETTINGS = {"top_p 0.95": (None, 0.95), "top_k 20 + top_p 0.95": (20, 0.95), "top_k 20": (20, None)}
# (programs per SM, chunks of that many times the fix's rows); (1, 1) is vLLM's own grid, min(SMs, rows): a control
VARIANTS = ((1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (8, 2))


def kernel_scope(source_dir: str, dry_run: bool) -> tuple[dict[str, Any], str]:
    """(vLLM 0.25.1's kernel module's globals, where they came from)."""
    sys.path.insert(0, str(ROOT))
    from trl_vlm_fixes.patches.sampling_parity import kernel_copy

    if dry_run:  # 2 compute units: vLLM's launch gives each program several of a chunk's rows, as on a GPU
        scope = kernel_copy.copy_namespace(kernel_copy.CUDA_TILES)  # the copy's own globals (this process's alone)
        scope["num_compute_units"] = lambda device_id=None: 2
        return scope, "the interpreted copy (dry run), 2 compute units"
    try:
        module = importlib.import_module(kernel_copy.KERNEL_MODULE)
    except ImportError:
        module = None
    if module is not None:
        if kernel_copy.proven_version() != "0.25.1":
            raise SystemExit(f"vLLM's {module.__file__} is not 0.25.1's kernel file: this record is of that one")
        return vars(module), f"vLLM's {module.__file__}"
    path = Path(source_dir) / "topk_topp_triton.py"
    if not path.is_file():
        raise SystemExit(
            f"no vLLM and no copy of its kernel file at {path}: carry .gpu/vllm_topk (see --kernel-source)"
        )
    source = path.read_text()
    digest = hashlib.sha256(source.encode()).hexdigest()
    if digest != kernel_copy.PROVEN_SHA256:
        raise SystemExit(f"{path} is not vLLM 0.25.1's kernel file (sha256 {digest[:12]})")
    replaced = {
        "from vllm.triton_utils import tl, triton": "import triton\nimport triton.language as tl",
        "from vllm.utils.math_utils import next_power_of_2": "",
        "from vllm.utils.platform_utils import num_compute_units": "",
    }
    for old, new in replaced.items():
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    staged = Path("/tmp/vllm_0_25_1_topk_topp_triton.py")  # Triton reads each kernel's source with inspect
    staged.write_text(source)
    units = torch.cuda.get_device_properties(0).multi_processor_count
    scope: dict[str, Any] = {
        "__name__": "vllm_0_25_1_topk_topp_triton",
        "__file__": str(staged),
        "next_power_of_2": lambda n: 1 << (n - 1).bit_length(),
        "num_compute_units": lambda device_id=None: units,
    }
    exec(compile(source, str(staged), "exec"), scope)
    return scope, f"a copy of vLLM 0.25.1's file ({path}, sha256 {digest[:12]})"


def timed_ms(function: Callable[[], Any], device: torch.device, repeats: int = 2) -> tuple[Any, float]:
    result = function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, (time.perf_counter() - started) / repeats * 1e3


def cut_path(
    scope: dict[str, Any], wide: Any, logits: torch.Tensor, ids: torch.Tensor, chunk: int, k: Any, p: Any
) -> dict[str, Any]:
    """The wide launch against vLLM's over all positions, a chunk at a time, on the same float32 rows: the positions
    whose masked logits differ in any bit, those whose processed log-prob differs, and the median kept tokens."""
    differing_rows = differing_logprobs = 0
    kept = []
    for start in range(0, logits.size(0), chunk):
        rows = logits[start : start + chunk].float()
        k_rows = None if k is None else torch.full((rows.size(0),), k, dtype=torch.int32, device=rows.device)
        p_rows = None if p is None else torch.full((rows.size(0),), p, dtype=torch.float32, device=rows.device)
        theirs = scope["apply_top_k_top_p_triton"](rows.clone(), k_rows, p_rows)
        ours = wide.wide_top_k_top_p(scope, "cuda", rows, k_rows, p_rows)
        same = (theirs == ours) | (theirs.isnan() & ours.isnan())
        differing_rows += int((~same.all(-1)).sum())
        index = ids[start : start + chunk, None]
        logprob_ours = ours.log_softmax(-1).gather(1, index)
        differing_logprobs += int((logprob_ours != theirs.log_softmax(-1).gather(1, index)).sum())
        kept.append((theirs > -math.inf).sum(-1))
    return {
        "kept_tokens_median": float(torch.cat(kept).float().median()),
        "differing_masked_rows": differing_rows,
        "differing_logprob_bits": differing_logprobs,
    }


def stages(logits: torch.Tensor, ids: torch.Tensor, chunk: int, device: torch.device) -> dict[str, float]:
    """The cut path's other stages over all positions (ms): the float32 copy; log_softmax and the gather."""
    rows = logits[:chunk].float()
    _, copy_ms = timed_ms(lambda: logits[:chunk].float(), device)
    _, softmax_ms = timed_ms(lambda: rows.log_softmax(-1).gather(1, ids[:chunk, None]), device)
    chunks = logits.size(0) / chunk
    return {"float32_copy_ms": copy_ms * chunks, "log_softmax_gather_ms": softmax_ms * chunks}


def kernel_ms(
    scope: dict[str, Any],
    wide: Any,
    launch: str,
    logits: torch.Tensor,
    chunk: int,
    k: Any,
    p: Any,
    device: torch.device,
    repeats: int = 5,
) -> float:
    """The kernel alone over all positions (ms): the median of ``repeats`` sweeps (after one that compiles and warms
    up) of each chunk's launch, timed alone (CUDA events around the launch; the kernel masks in place, so the chunk's
    float32 values are restored before each launch, untimed)."""
    sources = [logits[start : start + chunk].float() for start in range(0, logits.size(0), chunk)]
    work = torch.empty_like(sources[0])
    totals = []
    for _ in range(repeats + 1):
        spans = []
        for source in sources:
            rows = work[: source.size(0)]
            rows.copy_(source)
            k_rows = None if k is None else torch.full((rows.size(0),), k, dtype=torch.int32, device=device)
            p_rows = None if p is None else torch.full((rows.size(0),), p, dtype=torch.float32, device=device)
            if launch == "vllm":
                call = functools.partial(scope["apply_top_k_top_p_triton"], rows, k_rows, p_rows)
            else:
                call = functools.partial(wide.wide_top_k_top_p, scope, "cuda", rows, k_rows, p_rows)
            spans.append(span(call, device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        totals.append(sum(elapsed() for elapsed in spans))
    return statistics.median(totals[1:])


def span(function: Callable[[], Any], device: torch.device) -> Callable[[], float]:
    """Run ``function``; return what gives its time in ms (on CUDA: events, read after a synchronize)."""
    if device.type != "cuda":
        started = time.perf_counter()
        function()
        seconds = time.perf_counter() - started
        return lambda: seconds * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    function()
    end.record()
    return lambda: begin.elapsed_time(end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=16384, help="16 x 1,024")
    parser.add_argument("--vocabulary", default="151936,248320")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, small shapes")
    parser.add_argument("--out", default="cut_launch.json")
    parser.add_argument("--kernel-source", default=str(ROOT / ".gpu" / "vllm_topk"), help="a copy of 0.25.1's file")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    scope, origin = kernel_scope(args.kernel_source, args.dry_run)
    sys.path.insert(0, str(ROOT))
    from trl_vlm_fixes.patches.sampling_parity import kernel_copy, wide_launch

    vocabularies = [20000] if args.dry_run else [int(v) for v in args.vocabulary.split(",")]
    positions = 12 if args.dry_run else args.positions
    report: dict[str, Any] = {
        "device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernel": origin,
        "compute_units": scope["num_compute_units"](0),
        "results": [],
    }
    variants = ((1, 1), (4, 2)) if args.dry_run else VARIANTS
    default_width = wide_launch.PROGRAMS_PER_UNIT
    block = kernel_copy.interpreting if args.dry_run else contextlib.nullcontext
    for vocabulary in vocabularies:
        chunk = 5 if args.dry_run else CHUNK_ELEMENTS // vocabulary
        for spread, std in SPREADS.items():
            generator = torch.Generator(device=device).manual_seed(vocabulary)
            logits = (torch.randn(positions, vocabulary, generator=generator, device=device) * std).bfloat16()
            ids = logits.float().softmax(-1).multinomial(1, generator=generator).squeeze(1)
            other = stages(logits, ids, chunk, device)
            for setting, (k, p) in SETTINGS.items():
                entry: dict[str, Any] = {"vocabulary": vocabulary, "spread": spread, "setting": setting}
                entry.update(positions=positions, chunk=chunk, **other)
                with block():
                    entry["vllm_launch_ms"] = kernel_ms(scope, wide_launch, "vllm", logits, chunk, k, p, device)
                    for width, times in variants:
                        rows = times * chunk
                        wide_launch.PROGRAMS_PER_UNIT = width
                        name = f"wide_{width}_per_sm_chunk_{rows}"
                        entry[name] = cut_path(scope, wide_launch, logits, ids, rows, k, p)
                        entry[name]["ms"] = kernel_ms(scope, wide_launch, "wide", logits, rows, k, p, device)
                    wide_launch.PROGRAMS_PER_UNIT = default_width
                    entry["vllm_launch_ms_after"] = kernel_ms(scope, wide_launch, "vllm", logits, chunk, k, p, device)
                recorded(report, entry, args.out)
            del logits
            if device.type == "cuda":
                torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=2))


def recorded(report: dict[str, Any], entry: dict[str, Any], out: str) -> None:
    """``entry`` into the report's results, printed, and the report so far written (a run cut short keeps it)."""
    report["results"].append(entry)
    print(json.dumps(entry), flush=True)
    Path(out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
