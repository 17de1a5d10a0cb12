"""How the cuts' kernel time depends on the rows of one launch: the wide launch (one program per row) over the same
positions in chunks of other sizes, and what the compiled kernel lets run at once on one SM.

    python benchmarks/gpu/cut_waves.py [--positions 16384] [--vocabulary 151936,248320] [--out FILE]
    python benchmarks/gpu/cut_waves.py --dry-run   # the CPU, Triton's interpreter, small shapes

The record of ``cut_launch.py`` (docs/gpu-results.md, section 19; vLLM 0.25.1's kernel, 4 warps, synthetic logits)
found chunks of twice the fix's rows 0.77-0.84x as long per position at 248,320 tokens (270 rows a chunk) and
0.93-0.98x at 151,936 (441): a launch's programs may run in waves of what fits on the SMs at once, so a chunk a few
rows over a wave's size pays a whole wave for them (if an SM holds 2 programs, a wave is 264 rows on an H100). This
script times the kernel (CUDA events around each launch, median of 5 sweeps, ``cut_launch.kernel_ms``: the events
hold the launch's host work too, some 10 microseconds a launch, which weighs more on small chunks) at chunks of
multiples of the SM count and at the fix's own chunk, checks the bits against vLLM's launch (``cut_launch.cut_path``),
and estimates from the compiled kernel's registers, warps and shared memory (Triton's ``CompiledKernel``) how many of
its programs one SM holds. vLLM 0.25.1's kernel file only (0.31 launches its kernel with 8 warps: another build).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cut_launch  # the same directory: its kernel loading, timing and bit checks

SETTINGS = {"top_k 20 + top_p 0.95": (20, 0.95), "top_p 0.95": (None, 0.95)}
WAVE_MULTIPLES = (1, 2, 3, 4)  # chunks of this many times the SM count, beside the fix's own chunk


def resident_programs(scope: dict[str, Any]) -> dict[str, Any]:
    """Each compiled variant of vLLM 0.25.1's monolithic kernel in ``scope`` (labelled by its constexprs: vocabulary,
    tiles, top-k/top-p on or off): registers, warps, shared memory, and how many of its programs one SM holds by each
    (H100/H200: 4 quarters of 16,384 registers given to a warp in units of 256, 64 warps, 32 programs, 228 KiB of
    shared memory with 1 KiB reserved per program). An estimate from the compiled binary's figures, not measured."""
    kernel = scope["_topk_topp_kernel"]
    found = []
    for caches in getattr(kernel, "device_caches", {}).values():
        for compiled in caches[0].values():
            with contextlib.suppress(Exception):
                compiled._init_handles()  # n_regs is read when the binary is loaded
            warps = int(compiled.metadata.num_warps)
            registers = int(getattr(compiled, "n_regs", 0) or 0)
            shared = int(compiled.metadata.shared)
            per_warp = -(-registers * 32 // 256) * 256
            fit = {
                "by_registers": 4 * (16384 // per_warp) // warps if registers else None,
                "by_warps": 64 // warps,
                "by_programs": 32,
                "by_shared_memory": (228 * 1024) // (shared + 1024),
            }
            limits = [value for value in fit.values() if value]
            constants = getattr(getattr(compiled, "src", None), "constants", {})
            found.append(
                {"constexprs": {str(key): str(value) for key, value in dict(constants).items()}}
                | {"num_warps": warps, "registers": registers, "local_memory_words": int(compiled.n_spills)}
                | {"shared": shared}
                | fit
                | {"programs_per_sm": min(limits) if limits else None}
            )
    return {"compiled": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=16384)
    parser.add_argument("--vocabulary", default="151936,248320")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, small shapes")
    parser.add_argument("--out", default="cut_waves.json")
    parser.add_argument("--kernel-source", default=str(cut_launch.ROOT / ".gpu" / "vllm_topk"))
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    scope, origin = cut_launch.kernel_scope(args.kernel_source, args.dry_run)
    from trl_vlm_fixes.patches.sampling_parity import kernel_copy, wide_launch

    units = int(scope["num_compute_units"](0))
    vocabularies = [20000] if args.dry_run else [int(v) for v in args.vocabulary.split(",")]
    positions = 12 if args.dry_run else args.positions
    report: dict[str, Any] = {"device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name()}
    report.update(kernel=origin, compute_units=units, programs_per_unit=wide_launch.PROGRAMS_PER_UNIT, results=[])
    block = kernel_copy.interpreting if args.dry_run else contextlib.nullcontext
    repeats = 1 if args.dry_run else 5
    for vocabulary in vocabularies:
        own = 5 if args.dry_run else cut_launch.CHUNK_ELEMENTS // vocabulary
        multiples = WAVE_MULTIPLES[:2] if args.dry_run else WAVE_MULTIPLES
        chunks = sorted({own, *(units * multiple for multiple in multiples)})
        generator = torch.Generator(device=device).manual_seed(vocabulary)
        logits = (torch.randn(positions, vocabulary, generator=generator, device=device) * 4.5).bfloat16()
        ids = logits.float().softmax(-1).multinomial(1, generator=generator).squeeze(1)
        for setting, (k, p) in SETTINGS.items():
            entry: dict[str, Any] = {"vocabulary": vocabulary, "spread": "peaked", "setting": setting}
            entry.update(positions=positions, fix_chunk=own)
            with block():
                entry["vllm_launch_ms"] = cut_launch.kernel_ms(
                    scope, wide_launch, "vllm", logits, own, k, p, device, repeats
                )
                for rows in chunks:
                    result = cut_launch.cut_path(scope, wide_launch, logits, ids, rows, k, p)
                    result["ms"] = cut_launch.kernel_ms(scope, wide_launch, "wide", logits, rows, k, p, device, repeats)
                    result["programs"] = wide_launch.programs_for(rows, units)
                    entry[f"chunk_{rows}"] = result
            cut_launch.recorded(report, entry, args.out)
        del logits
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["kernel_fit"] = resident_programs(scope)
    print(json.dumps(report["kernel_fit"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
