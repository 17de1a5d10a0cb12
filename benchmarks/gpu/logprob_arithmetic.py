"""Whose float32 log-prob arithmetic agrees with whose on a GPU, summed over a completion (issue 43: the IS weight of a
2,048-token completion within 1e-4 of 1 where engine and trainer see the same logits).

The engine's log-prob of a sampled token, as vLLM 0.25.1 computes it on CUDA: V1 divides a float32 copy of the logits by
the request's temperature tensor (``Sampler.apply_temperature``) and runs torch's ``log_softmax``
(``Sampler.compute_logprobs``); V2 runs its own Triton temperature kernel and its Triton log-softmax
(``compute_token_logprobs``: block sums of Triton's own ``exp``). Each is compared with float64 arithmetic on the same
float32 values (its own rounding, and whether it is one-signed), and each trainer path with the engine it faces:
sampling_parity's plain log-prob (``Positions.plain_log_probs``: the engine's temperature step and its own
log-softmax, from TRL 1.9.1's logits or from hidden states projected again), and TRL 1.16's fused head
(``trl.kernels.chunked_logprob.ChunkedLogProbFunction``: the logits projected in 32,768-token tiles and folded into an
online log-sum-exp, the temperature a multiplication by its reciprocal) on hidden states and an output layer whose
bf16 product is the engine's logits.

Per pair: the largest |difference| per token, the mean signed difference (a bias adds up over a completion), and the
largest |sum| over one completion of ``--width`` tokens (the log of the IS weight's error at that length). Also the
milliseconds, over ``--positions`` positions in the fix's chunks, of each engine function on a float32 copy against
the same function without the copy (bit for bit?), of one projection of every position through the output layer,
and of TRL 1.16's fused head. ``--dry-run``: the CPU, small shapes, Triton's interpreter (a check of the script).
``--trl116 PATH``: TRL 1.16's ``chunked_logprob.py`` (the bundles hold TRL 1.9.1).

The record of 2026-12-07 (docs/gpu-logprob-arithmetic.json) was taken at b628cc7, when the script also ran
sampling_parity's one-pass kernel (removed after it: one-signed against both engines).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trl_vlm_fixes.patches.sampling_parity import processed
from trl_vlm_fixes.patches.sampling_parity.distribution import V1_RUNNER, V2_RUNNER
from trl_vlm_fixes.selftest import v2_kernels

CHUNK = 2048  # positions per float32 (and float64) copy
TILE = 32768  # TRL 1.16's vocabulary tile (_CHUNKED_LOGPROB_CHUNK_SIZE)
LogProbPath = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def trained_logits(positions: int, vocabulary: int, device: torch.device, seed: int) -> torch.Tensor:
    """bf16 logits of std 4.5 (4.1-4.4 nats of entropy at 151,936-248,320 tokens: a peaked spread)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(positions, vocabulary, generator=generator, device=device) * 4.5).to(torch.bfloat16)


def sampled(logits: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=logits.device).manual_seed(seed)
    ids = [
        torch.multinomial(torch.softmax(part.float(), -1), 1, generator=generator).squeeze(1)
        for part in logits.split(CHUNK)
    ]
    return torch.cat(ids)


def chunked(path: LogProbPath) -> LogProbPath:
    """``path`` over ``CHUNK`` positions at a time (one float32 copy of a chunk at a time)."""

    def run(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        parts = [path(a, b, temperature) for a, b in zip(logits.split(CHUNK), ids.split(CHUNK), strict=True)]
        return torch.cat(parts)

    return run


def v1_scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """V1's float32 copy divided by the request's temperature tensor (skipped at 1, as the engine skips it)."""
    from vllm.v1.sample.sampler import Sampler

    work = logits.float()
    if temperature != 1.0:
        Sampler.apply_temperature(work, torch.full((work.size(0),), temperature, device=work.device), True)
    return work


def engine_v1(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    from vllm.v1.sample.sampler import Sampler

    return Sampler.compute_logprobs(v1_scaled(logits, temperature)).gather(1, ids[:, None]).squeeze(1)


class V2:
    """V2's temperature kernel and log-softmax kernel (vLLM's own compiled on a GPU, interpreted on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.engine = v2_kernels.Engine(device)

    def scaled(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        return self.engine.temperature(logits, temperature)

    def log_probs(self, logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        return self.engine.logprobs(self.scaled(logits, temperature), ids[:, None])


def exact(scale: Callable[[torch.Tensor, float], torch.Tensor]) -> LogProbPath:
    """float64 log-softmax of the float32 values the engine's temperature step gives."""

    def run(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        values = scale(logits, temperature).double()
        return (values.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(values, -1)).float()

    return run


def torch_path(runner: str) -> LogProbPath:
    def run(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        positions = processed.Positions(logits[:, :1].float(), None, logits)
        return positions.plain_log_probs(temperature, ids, runner)

    return run


def gaps(ours: torch.Tensor, theirs: torch.Tensor, width: int) -> dict[str, Any]:
    gap = (ours.double() - theirs.double()).view(-1, width)
    return {
        "finite": bool(torch.isfinite(ours).all() and torch.isfinite(theirs).all()),
        "max": float(gap.abs().max()),
        "bias": float(gap.mean()),
        "completion_sum_max": float(gap.sum(dim=1).abs().max()),
    }


def synchronized(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(function: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    result = function()
    synchronized(device)
    start = time.perf_counter()
    for _ in range(3):
        result = function()
    synchronized(device)
    return result, (time.perf_counter() - start) / 3 * 1e3


def logits_record(
    positions: int, width: int, vocabulary: int, temperature: float, device: torch.device, v2: V2
) -> dict[str, Any]:
    """Section A: the same bf16 logits on both sides."""
    logits = trained_logits(positions, vocabulary, device, seed=0)
    ids = sampled(logits, seed=1)
    engines = {
        "v1": chunked(engine_v1)(logits, ids, temperature),
        "v2": chunked(v2.log_probs)(logits, ids, temperature),
    }
    exacts = {
        "v1": chunked(exact(v1_scaled))(logits, ids, temperature),
        "v2": chunked(exact(v2.scaled))(logits, ids, temperature),
    }
    trainers: dict[str, tuple[str, LogProbPath]] = {
        "the fix (V1)": ("v1", torch_path(V1_RUNNER)),
        "the fix (V2)": ("v2", torch_path(V2_RUNNER)),
    }
    record: dict[str, Any] = {
        "section": "same logits",
        "positions": positions,
        "width": width,
        "vocabulary": vocabulary,
        "temperature": temperature,
        "entropy": float(entropy(logits[:CHUNK])),
        "engine_vs_float64": {name: gaps(engines[name], exacts[name], width) for name in engines},
        "trainer_vs_engine": {},
        "trainer_vs_float64": {},
    }
    for name, (runner, path) in trainers.items():
        values = chunked(path)(logits, ids, temperature)
        record["trainer_vs_engine"][name] = gaps(values, engines[runner], width)
        record["trainer_vs_float64"][name] = gaps(values, exacts[runner], width)
    return record


def entropy(logits: torch.Tensor) -> torch.Tensor:
    values = logits.float()
    return -(torch.softmax(values, -1) * torch.log_softmax(values, -1)).sum(-1).mean()


def load_trl116(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("trl116_chunked_logprob", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ChunkedLogProbFunction


def fused_head_record(
    positions: int,
    width: int,
    vocabulary: int,
    hidden_size: int,
    temperature: float,
    device: torch.device,
    v2: V2,
    function: Any,
) -> dict[str, Any]:
    """Section B: TRL 1.16's fused head on hidden states whose product with the output layer is the engine's logits."""
    generator = torch.Generator(device=device).manual_seed(2)
    hidden = torch.randn(positions, hidden_size, generator=generator, device=device).to(torch.bfloat16)
    weight = (torch.randn(vocabulary, hidden_size, generator=generator, device=device) * (4.5 / hidden_size**0.5)).to(
        torch.bfloat16
    )
    logits, projection_ms = timed_ms(lambda: torch.nn.functional.linear(hidden, weight), device)  # the engine's head
    ids = sampled(logits, seed=3)
    with torch.no_grad():
        fused, fused_ms = timed_ms(
            lambda: function.apply(hidden, weight, None, ids, temperature, TILE, None, 1.0, ())[0], device
        )
    tile_rows = min(positions, CHUNK)
    differing = 0
    buffer = torch.empty(tile_rows, TILE, dtype=torch.bfloat16, device=device)
    for start in range(0, vocabulary, TILE):  # TRL's tiles (torch.mm into a tile buffer) against the whole product
        end = min(start + TILE, vocabulary)
        tile = buffer[:, : end - start]
        torch.mm(hidden[:tile_rows], weight[start:end].t(), out=tile)
        differing += int((tile != logits[:tile_rows, start:end]).sum())
    engines = {
        "v1": chunked(engine_v1)(logits, ids, temperature),
        "v2": chunked(v2.log_probs)(logits, ids, temperature),
    }
    exact_v1 = chunked(exact(v1_scaled))(logits, ids, temperature)
    layer = processed.OutputLayer(weight)
    reprojected = {  # the fix on TRL 1.16: the hidden states projected again, the engine's own log-softmax
        name: processed.Positions(hidden, layer).plain_log_probs(temperature, ids, runner)
        for name, runner in (("v1", V1_RUNNER), ("v2", V2_RUNNER))
    }
    return {
        "section": "TRL 1.16's fused head",
        "positions": positions,
        "width": width,
        "vocabulary": vocabulary,
        "hidden": hidden_size,
        "temperature": temperature,
        "entropy": float(entropy(logits[:CHUNK])),
        "tile_logits_differing": differing,
        "tile_logits_compared": tile_rows * vocabulary,
        "fused_vs_engine": {name: gaps(fused, values, width) for name, values in engines.items()},
        "reprojected_vs_engine": {name: gaps(reprojected[name], values, width) for name, values in engines.items()},
        "fused_vs_float64": gaps(fused, exact_v1, width),
        "engine_v1_vs_float64": gaps(engines["v1"], exact_v1, width),
        "projection_ms": projection_ms,
        "fused_head_ms": fused_ms,
    }


def engine_function_record(positions: int, vocabulary: int, device: torch.device, v2: V2) -> dict[str, Any]:
    """Section C, temperature 1: the engine's own log-softmax run on TRL's bf16 logits without a float32 copy, bit
    for bit against the same function on the float32 copy the engine makes (V1: torch's ``log_softmax(...,
    dtype=float32)``; V2: ``compute_token_logprobs``, which upcasts each element as it reads it), and the time of
    each way over ``positions`` positions in the fix's chunks (``processed.CHUNK_ELEMENTS``)."""
    from vllm.v1.sample.sampler import Sampler

    logits = trained_logits(positions, vocabulary, device, seed=4)
    ids = sampled(logits, seed=5)
    step = max(1, processed.CHUNK_ELEMENTS // vocabulary)

    def over_chunks(path: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return lambda: torch.cat([path(a, b) for a, b in zip(logits.split(step), ids.split(step), strict=True)])

    def v1_copy(part: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return Sampler.compute_logprobs(part.float()).gather(1, chosen[:, None]).squeeze(1)

    def v1_upcast(part: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(part, dim=-1, dtype=torch.float32).gather(1, chosen[:, None]).squeeze(1)

    def v2_copy(part: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return v2.engine.logprobs(part.float(), chosen[:, None])

    def v2_direct(part: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return v2.engine.logprobs(part, chosen[:, None])

    ways = {"v1 copy": v1_copy, "v1 upcast": v1_upcast, "v2 copy": v2_copy, "v2 direct": v2_direct}
    values, times = {}, {}
    for name, path in ways.items():
        values[name], times[name] = timed_ms(over_chunks(path), device)
    return {
        "section": "engine functions",
        "positions": positions,
        "vocabulary": vocabulary,
        "chunk_positions": step,
        "v1_upcast_differing": int((values["v1 upcast"] != values["v1 copy"]).sum()),
        "v2_direct_differing": int((values["v2 direct"] != values["v2 copy"]).sum()),
        "ms": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8, help="completions")
    parser.add_argument("--width", type=int, default=2048, help="tokens per completion")
    parser.add_argument("--vocabulary", default="151936,248320")
    parser.add_argument("--temperatures", default="1.0,0.7")
    parser.add_argument("--hidden", type=int, default=2048, help="TRL 1.16 section: the output layer's input size")
    parser.add_argument("--trl116", default="", help="TRL 1.16's trl/kernels/chunked_logprob.py (section B)")
    parser.add_argument("--positions", type=int, default=16384, help="section C: positions timed (16 x 1,024)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, small shapes")
    parser.add_argument("--out", default="logprob_arithmetic.json")
    args = parser.parse_args()
    device = torch.device("cpu" if args.dry_run else "cuda")
    rows, width = (2, 64) if args.dry_run else (args.rows, args.width)
    vocabularies = [2048] if args.dry_run else [int(v) for v in args.vocabulary.split(",")]
    hidden_size = 64 if args.dry_run else args.hidden
    temperatures = [float(t) for t in args.temperatures.split(",")]
    v2 = V2(device)
    function = load_trl116(args.trl116) if args.trl116 else None
    report: dict[str, Any] = {
        "device": "cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "results": [],
    }
    for vocabulary in vocabularies:
        positions = 256 if args.dry_run else args.positions
        report["results"].append(engine_function_record(positions, vocabulary, device, v2))
        for temperature in temperatures:
            started = time.perf_counter()
            report["results"].append(logits_record(rows * width, width, vocabulary, temperature, device, v2))
            if function is not None:
                report["results"].append(
                    fused_head_record(rows * width, width, vocabulary, hidden_size, temperature, device, v2, function)
                )
            print(f"V={vocabulary} T={temperature}: {time.perf_counter() - started:.1f} s", flush=True)
            Path(args.out).write_text(json.dumps(report, indent=2))
    print_report(report)


def print_report(report: dict[str, Any]) -> None:
    print(report["device"])
    line = "{:>8} {:>4} {:<40} {:>9} {:>10} {:>10}"
    print(line.format("vocab", "T", "pair", "max", "bias", "sum max"))
    for record in report["results"]:
        if record["section"] == "engine functions":
            times = ", ".join(f"{name} {ms:.1f}" for name, ms in record["ms"].items())
            print(
                f"{record['vocabulary']:>8} engine functions on {record['positions']} positions: V1 upcast differs in "
                f"{record['v1_upcast_differing']}, V2 direct in {record['v2_direct_differing']}; ms: {times}"
            )
            continue
        pairs: list[tuple[str, dict[str, Any]]] = []
        if record["section"] == "same logits":
            pairs += [(f"engine {k} - float64", v) for k, v in record["engine_vs_float64"].items()]
            pairs += [(f"{k} - engine", v) for k, v in record["trainer_vs_engine"].items()]
            pairs += [(f"{k} - float64", v) for k, v in record["trainer_vs_float64"].items()]
        else:
            pairs += [(f"TRL 1.16 head - engine {k}", v) for k, v in record["fused_vs_engine"].items()]
            pairs += [(f"the fix, reprojected - engine {k}", v) for k, v in record["reprojected_vs_engine"].items()]
            pairs += [("TRL 1.16 head - float64", record["fused_vs_float64"])]
            pairs += [("engine v1 - float64 (projected)", record["engine_v1_vs_float64"])]
        for name, gap in pairs:
            print(
                line.format(
                    record["vocabulary"],
                    record["temperature"],
                    name[:40],
                    f"{gap['max']:.2g}",
                    f"{gap['bias']:.2g}",
                    f"{gap['completion_sum_max']:.2g}",
                )
            )
        if record["section"] != "same logits":
            print(
                f"    tiles vs whole product: {record['tile_logits_differing']} of {record['tile_logits_compared']} "
                f"logits differ; projection {record['projection_ms']:.1f} ms, "
                f"TRL 1.16 head {record['fused_head_ms']:.1f} ms"
            )


if __name__ == "__main__":
    main()
