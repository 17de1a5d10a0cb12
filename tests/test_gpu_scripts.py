"""The GPU scripts' own logic, dry-run on the CPU with the stand-in engine (the GPU runs are in docs/gpu-results.md).

Each script runs as the GPU machine runs it (a parent writing the JSON record, one fresh process per variant), at the
tests' tiny model shape and 8-token completions: what is checked is the script (what it records, how it compares),
not a size.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import environment_without_switches, upstream_reloads_from_disk

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
SCRIPT = GPU / "grpo_end_to_end.py"
MOE_SCRIPT = GPU / "moe_colocate.py"
IS_MEAN = "sampling/importance_sampling_ratio/mean"
KEPT = "trl_vlm_fixes/sampling_kept_mass"


def _run(script: Path, out: Path, *arguments: str, timeout: int = 600) -> tuple[dict[str, Any], str]:
    env = environment_without_switches()
    env["PYTHONPATH"] = os.pathsep.join([str(GPU.parents[1]), env.get("PYTHONPATH", "")])
    command = [sys.executable, str(script), *arguments, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def _stale(rollouts: list[dict[str, Any]]) -> int:
    return sum(r["on_original"] and r["trainer_moved_from_original"] for r in rollouts)


# the GPU record runs on the validated stack only (vLLM 0.25.1 + TRL 1.9.1 bundles): its dry runs need no other.
# They check the GPU scripts (benchmarks, not the plugin: the plugin's behaviour on each path they run is the other
# test files'), so they run where those scripts are used: before a GPU record, `bash scripts/gpu_preflight.sh`
# (docs/development.md), not in CI, whose 30 minutes they took 7.7 of worker time from (2026-12-06).
pytestmark = [pytest.mark.stack_independent, pytest.mark.gpu_scripts]


def test_grpo_end_to_end_script_dry_run(tmp_path: Path) -> None:
    """Every variant, in the sampling phases the GPU run uses (``default`` then ``qwen``, one step each here)."""
    variants = "on,reload_skip_off,off,prompt_parity_off,sampling_parity_off"
    report, stdout = _run(
        SCRIPT, tmp_path / "grpo.json", "--stand-in", "--tiny", "--steps", "1", "--variants", variants,
        "--sampling", "default,qwen", "--max-completion-length", "8",
    )  # fmt: skip
    variants_ = report["variants"]
    on, reload_off, off = variants_["on"], variants_["reload_skip_off"], variants_["off"]
    parity_off = variants_["prompt_parity_off"]

    assert on["trained"] and on["weights_trained"] and len(on["rollouts"]) == 4  # 2 rollouts per optimizer step
    assert all(r["trainer_moved_from_original"] for r in on["rollouts"] if r["global_step"] > 0)
    assert all(r["on_current"] for r in on["rollouts"]) and on["disk_reloads"] == 0
    assert on["engine_cudagraph_mode"] in ("default", "FULL_AND_PIECEWISE")  # vLLM's own mode until a hang
    # vLLM's own processor behind the stand-in: every row identical with prompt_parity, rows of N > 1 pads not without
    assert all(r["identical_rows"] == r["rows"] for r in on["prompt_parity"]) and len(on["prompt_parity"]) == 4
    doubled = [t != e for r in parity_off["prompt_parity"] for t, e in r["image_pads_trainer_vs_engine"]]
    assert any(doubled) and sum(r["identical_rows"] for r in parity_off["prompt_parity"]) < 4 * 8

    assert reload_off["trained"] and len(reload_off["rollouts"]) == 4
    if upstream_reloads_from_disk():  # TRL 1.9.1: the reload puts the checkpoint back over the synced weights
        assert _stale(reload_off["rollouts"]) == 2 and reload_off["disk_reloads"] == 4
    else:
        assert _stale(reload_off["rollouts"]) == 0

    # upstream the step crashes: the mixed batch (mm_realign) or a sampled placeholder (vision_token_guard), whichever
    # the random policy reaches first
    assert not off["trained"] and ("shape mismatch" in off["error"] or "do not match" in off["error"]), off["error"]
    assert off["engine_cudagraph_mode"] in ("default", "FULL_AND_PIECEWISE")  # vLLM's own default graphs
    assert "on current" in stdout and "IS mean" in stdout  # both tables are printed

    # sampling_parity: per step the phase, TRL's ratio and gap, the kept share, the scoring pass's time
    sampling_off = variants_["sampling_parity_off"]
    assert sampling_off["trained"] and report["sampling"] == {"default": {}, "qwen": {"top_p": 0.95, "top_k": 20}}
    for result in (on, sampling_off):
        assert [s["sampling"] for s in result["sampling"]] == ["default", "qwen"]
        assert [r["sampling"] for r in result["scoring"]] == ["default"] * 2 + ["qwen"] * 2
        assert all(r["no_grad_passes"] >= 1 and r["scoring_s"] > 0 for r in result["scoring"])
        assert all(s["scoring_s"] > 0 and len(s["scoring_s_rollouts"]) == 2 for s in result["sampling"])
    default_on, qwen_on = on["sampling"]
    default_off, qwen_off = sampling_off["sampling"]
    # the stand-in serves the trainer's own weights: with the fix the ratio is 1 (the same distribution both sides)
    assert abs(default_on[IS_MEAN] - 1) < 1e-4 and abs(qwen_on[IS_MEAN] - 1) < 1e-4
    assert qwen_on["sampling/sampling_logp_difference/max"] < 1e-3
    # the kept share: the placeholder ban alone keeps almost everything, top_k=20 with top_p=0.95 clearly less
    assert 0.99 < default_on[KEPT] <= 1 and qwen_on[KEPT] < min(0.95, default_on[KEPT] - 0.05)
    # without it TRL's ratio is the product of the kept shares: below 1 with the ban, far below with top-k/top-p
    assert default_off[IS_MEAN] < 0.999 and qwen_off[IS_MEAN] < 0.5
    assert qwen_off["sampling/sampling_logp_difference/mean"] > 0.1 > qwen_on["sampling/sampling_logp_difference/mean"]
    comparison = report["sampling_parity"]
    assert set(comparison) == {"default", "qwen"} and comparison["qwen"]["is_mean_off"] == [qwen_off[IS_MEAN]]
    assert comparison["qwen"]["kept_mass_on"] == [qwen_on[KEPT]]


def test_moe_colocate_script_dry_run(tmp_path: Path) -> None:
    """A Qwen3.5 MoE VLM through the colocated stand-in: every engine tensor, the experts included, is the trainer's
    at every rollout, the prompts are the trainer's, the mixed batch trains with finite losses; with reload_skip off
    the comparison sees the checkpoint's experts served after step 0."""
    arguments = (
        "--stand-in",
        "--tiny",
        "--steps",
        "2",
        "--max-completion-length",
        "8",
        "--variants",
        "on,reload_skip_off",
    )
    report, stdout = _run(MOE_SCRIPT, tmp_path / "moe.json", *arguments)
    assert report["shape"]["family"] == "qwen3_5_moe" and report["shape"]["experts"] == 4
    on = report["variants"]["on"]
    assert on["trained"] and on["global_steps"] == 2 and on["losses_finite"], on.get("error")
    assert on["trainer_model"] == "Qwen3_5MoeForConditionalGeneration"
    assert len(on["weights"]) == 4 and on["disk_reloads"] == 0
    for rollout in on["weights"]:
        assert rollout["tensors_compared"] > 40 and rollout["unmapped_trainer_count"] == 0, rollout
        assert rollout["tensors_within_bf16"] == rollout["tensors_compared"] == rollout["tensors_exact"], rollout
        assert rollout["expert_tensors_compared"] == 4 and rollout["expert_tensors_within_bf16"] == 4  # 2 layers
        assert rollout["expert_layouts"] == ["same"] and rollout["max_abs_diff"] == 0
        if rollout["global_step"] > 0:  # the experts trained and the engine serves the trained ones
            assert rollout["expert_tensors_moved_in_trainer"] == 4 and rollout["expert_tensors_on_original"] == 0
    assert all(r["identical_rows"] == r["rows"] == 8 for r in on["prompt_parity"]) and len(on["prompt_parity"]) == 4
    assert all(math.isfinite(loss) for loss in on["losses"]) and "engine=trainer" in stdout

    # the contrast the GPU run records too: TRL 1.9.1's reload puts the checkpoint's experts back after every sync
    reload_off = report["variants"]["reload_skip_off"]
    assert reload_off["trained"] and reload_off["losses_finite"] and len(reload_off["weights"]) == 4
    stale = [r for r in reload_off["weights"] if r["global_step"] > 0]
    if upstream_reloads_from_disk():
        assert all(r["expert_tensors_on_original"] == r["expert_tensors_moved_in_trainer"] == 4 for r in stale), stale
        assert all(r["expert_tensors_within_bf16"] == 0 for r in stale) and reload_off["disk_reloads"] == 4
    else:
        assert all(r["tensors_within_bf16"] == r["tensors_compared"] for r in reload_off["weights"])


def test_moe_comparison_against_vllm_loader_on_cpu(tmp_path: Path) -> None:
    """The comparison the MoE record relies on, against vLLM 0.25.1's own model class and ``load_weights`` (built on
    the CPU): TRL's push lands every tensor where the comparison looks, and a stale expert is caught."""
    report, _ = _run(
        MOE_SCRIPT, tmp_path / "loader.json", "--cpu-loader-check", "--family", "qwen3_5_moe,qwen3_vl_moe", timeout=300
    )
    checks = {check["family"]: check for check in report["cpu_loader_check"]}
    assert set(checks) == {"qwen3_5_moe", "qwen3_vl_moe"}
    for family, check in checks.items():
        before, after, stale, repushed = (
            check[k] for k in ("before_push", "after_push", "stale_expert", "after_repush")
        )
        # before any push the engine holds vLLM's random weights: nothing may pass
        assert before["tensors_within_bf16"] == before["expert_tensors_within_bf16"] == 0, family
        for row in (after, repushed):
            assert row["tensors_within_bf16"] == row["tensors_compared"] == check["engine_parameters"], (family, row)
            assert row["expert_tensors_compared"] == 4 and row["expert_layouts"] == ["same"], (family, row)
            assert row["unmapped_engine_count"] == row["unmapped_trainer_count"] == 0, (family, row)
        assert stale["tensors_within_bf16"] == stale["tensors_compared"] - 1, (family, stale)
        assert len(stale["differing"]) == 1 and "layers.0.mlp.experts" in stale["differing"][0], (family, stale)
        assert any(name.endswith("w13_weight") for name in check["engine_expert_shapes"]), check["engine_expert_shapes"]


def test_every_tensor_script_dry_run(tmp_path: Path) -> None:
    """vLLM's real model classes on the CPU as the colocated engine: after every level-2 sleep whose wake leaves the
    pool zeroed (``driver``) or NaN, the plugin's push and reset give the fresh engine's prompt log-probs, through
    ``sync_weights`` and through TRL's ``generate``; with wake_reset off, the deepstack families' text prompt is NaN
    (their image prompt rewrites its own rows) and the others are unchanged. MoE families skip with ``--no-moe``."""
    script = GPU / "every_tensor.py"
    families = "qwen3_5,qwen3_vl,qwen3_vl_moe"
    report, stdout = _run(script, tmp_path / "every.json", "--stand-in", "--tiny", "--families", families)
    assert set(report["families"]) == set(families.split(","))
    for family, result in report["families"].items():
        assert result["fresh_finite"] and result["fix_states"]["wake_reset"] == "applied", result
        cycles = result["cycles"]
        for cycle in ("driver", "nan_pages", "generate_nan_pages"):
            assert all(r["equal"] and r["nan_positions"] == 0 for p, r in cycles[cycle].items() if p != "seconds")
        assert set(cycles["generate_nan_pages"]) == {"seconds", "text"} and set(cycles["nan_pages"]) > {"text", "image"}
        reset = [t["name"] for t in result["plain_tensors"] if t["reset_by_wake_reset"]]
        contrast = cycles["wake_reset_off_nan_pages"]
        assert contrast["image"]["equal"]
        if family.startswith("qwen3_vl"):
            assert reset == ["deepstack_input_embeds[0]", "deepstack_input_embeds[1]"]
            assert contrast["text"]["nan_positions"] == contrast["text"]["positions"] > 0
        else:
            assert reset == [] and contrast["text"]["equal"]
        assert family in stdout
    skipped, _ = _run(script, tmp_path / "skip.json", "--stand-in", "--tiny", "--families", "qwen3_5_moe", "--no-moe")
    assert skipped["families"] == {"qwen3_5_moe": {"skipped": "not run (--no-moe)"}}


def test_cudagraph_decode_script_dry_run(tmp_path: Path) -> None:
    report, _ = _run(
        GPU / "cudagraph_decode.py", tmp_path / "d.json", "--stand-in", "--tiny", "--shapes", "2b",
        "--modes", "FULL_AND_PIECEWISE,PIECEWISE", "--batches", "2,4", "--tokens", "4", "--repeats", "1",
    )  # fmt: skip
    results = report["shapes"]["2b"]
    assert results["FULL_AND_PIECEWISE"]["cudagraph_mode_built"] == "FULL_AND_PIECEWISE"
    assert results["PIECEWISE"]["cudagraph_mode_built"] == "PIECEWISE"
    assert set(results["PIECEWISE"]["vs_vllm_default"]) == {"2", "4"}


def test_hang_restart_script_dry_run(tmp_path: Path) -> None:
    """A wedged colocated generate exits 75; the restart in the same output_dir builds PIECEWISE and trains on from
    the checkpoint (a CPU limit of 45 s: a stand-in step on a busy 2-core machine once took over 10 s)."""
    report, _ = _run(GPU / "hang_restart.py", tmp_path / "h.json", "--stand-in", "--tiny", "--limit", "45", timeout=900)
    assert report["verdict"] == {
        "hung_run_exit_75": True,
        "hung_run_mode": "FULL_AND_PIECEWISE",
        "restart_mode": "PIECEWISE",
        "restart_resumed_at_wedge_step": True,
        "restart_trained_to_the_end": True,
    }


def test_sampler_path_script_dry_run(tmp_path: Path) -> None:
    """sampling_parity's engine wrapper against vLLM's own dispatch: the wrapped call equals the trainer's rule at every
    batch size, and steps of 8 or more requests (vLLM's own kernel path) keep exactly the sets vLLM keeps."""
    report, _ = _run(GPU / "sampler_path.py", tmp_path / "o.json", "--dry-run")
    results = report["results"]
    assert results and all(row["wrapped_equals_rule"] for row in results)
    assert {row["batch"] for row in results} >= {1, 8}
    assert all(row["rows_whose_kept_set_differs_from_vllms"] == 0 for row in results if row["batch"] >= 8)


def test_v2_sampler_kernels_script_dry_run(tmp_path: Path) -> None:
    """V2's sampling kernels (interpreted here) against the trainer: every row finite, V2's steps within 1e-6 of the
    engine on every setting, V1's off at the boundary rows the script builds."""
    report, stdout = _run(GPU / "v2_sampler_kernels.py", tmp_path / "v2.json", "--dry-run")
    [result] = report["results"]
    assert result["rows"] == 8 and len(result["settings"]) >= 5
    for row in result["settings"]:
        assert row["rows_not_finite"] == 0 and row["v2_steps_max"] < 1e-6, row
    assert result["boundary"]["rows"] > 0 and result["boundary"]["v2_steps_max"] < 1e-6
    assert result["boundary"]["v1_steps_max"] > 1e-4, result["boundary"]
    for ulps in result["temperature_ulps"]:  # the interpreter divides as IEEE division does, the trainer as it
        assert ulps["max_ulps"] == 0 and ulps["trainer_elements_differing"] == 0, ulps
    assert "min-p boundary rows" in stdout


def test_logprob_arithmetic_script_dry_run(tmp_path: Path) -> None:
    """The log-prob arithmetic record (kernels interpreted here): the fix's plain log-prob is V1's engine function's,
    bit for bit, from TRL's logits and from hidden states projected again (TRL 1.16's fused head, where its kernel is
    installed); every value finite; the engine functions' timing section ran."""
    import importlib.util

    spec = importlib.util.find_spec("trl.kernels") and importlib.util.find_spec("trl.kernels.chunked_logprob")
    trl116 = ["--trl116", spec.origin] if spec and spec.origin else []
    report, stdout = _run(GPU / "logprob_arithmetic.py", tmp_path / "arithmetic.json", "--dry-run", *trl116)
    sections = [record["section"] for record in report["results"]]
    assert sections.count("same logits") == 2 and sections.count("engine functions") == 1, sections
    for record in report["results"]:
        if record["section"] == "engine functions":
            assert record["v1_upcast_differing"] == 0 and set(record["ms"]) >= {"v1 copy", "v2 copy"}, record
        elif record["section"] == "same logits":
            fix = record["trainer_vs_engine"]["the fix (V1)"]
            assert fix["finite"] and fix["max"] == 0.0, fix
        else:
            reprojected = record["reprojected_vs_engine"]["v1"]
            assert reprojected["finite"] and reprojected["max"] == 0.0, reprojected
    assert sections.count("TRL 1.16's fused head") == (2 if trl116 else 0)
    assert "engine v1 - float64" in stdout


def test_v1_log_softmax_script_dry_run(tmp_path: Path) -> None:
    """The V1 and V2 kernels' record (kernels interpreted here): every spread x temperature and the scoring-pass
    section recorded and timed (on the CPU torch's own function sums in another order: V1's bit comparisons are the
    GPU's to make); V2's reader equals V2's own kernels, both interpreted, at each temperature; the fix's path equals
    the copy's for both runners here (off CUDA the kernels are never asked)."""
    report, _ = _run(GPU / "v1_log_softmax.py", tmp_path / "v1.json", "--dry-run", "--scoring", "8")
    kernel = [r for r in report["results"] if "kernel_vs_torch" in r]
    v2 = [r for r in report["results"] if r.get("section") == "V2"]
    scoring = [r for r in report["results"] if r.get("section") == "scoring pass"]
    assert len(kernel) == 6 and len(v2) == 2 and len(scoring) == 1, report
    assert all(r["torch_path_ms"] > 0 and r["kernel_ms"] > 0 for r in kernel)
    for record in v2:
        assert record["kernel_vs_v2"]["differing"] == record["kernel_vs_v2_likeliest"]["differing"] == 0, record
        assert record["kernel_vs_v2"]["positions"] > 0 and record["kernel_ms"] > 0, record
    for runner in ("v1", "v2"):
        assert scoring[0][runner]["fix_vs_copy"]["differing"] == 0 and scoring[0][runner]["kernel_trusted"] is None


def test_cut_launch_script_dry_run(tmp_path: Path) -> None:
    """The cuts' GPU record (the kernel interpreted here): every spread x setting timed for vLLM's launch and each
    wide variant, each cutting, and no wide variant's masked logits or log-probs differing from vLLM's launch."""
    report, _ = _run(GPU / "cut_launch.py", tmp_path / "cut.json", "--dry-run")
    assert len(report["results"]) == 6, report
    for record in report["results"]:
        assert record["vllm_launch_ms"] > 0 and record["float32_copy_ms"] > 0, record
        variants = [value for key, value in record.items() if key.startswith("wide_")]
        assert len(variants) == 2, record
        for variant in variants:
            assert variant["ms"] > 0 and 0 < variant["kept_tokens_median"] < record["vocabulary"], record
            assert variant["differing_masked_rows"] == variant["differing_logprob_bits"] == 0, record


def test_cut_waves_script_dry_run(tmp_path: Path) -> None:
    """The cuts' chunk-size record (the kernel interpreted here): each chunk size cuts, no chunk's masked logits or
    log-probs differ from vLLM's launch, and the fix's own chunk is among those timed."""
    report, _ = _run(GPU / "cut_waves.py", tmp_path / "waves.json", "--dry-run")
    assert len(report["results"]) == 2 and "kernel_fit" in report, report
    for record in report["results"]:
        chunks = {key: value for key, value in record.items() if key.startswith("chunk_")}
        assert f"chunk_{record['fix_chunk']}" in chunks and len(chunks) >= 3, record
        for result in chunks.values():
            assert result["ms"] > 0 and 0 < result["kept_tokens_median"] < record["vocabulary"], record
            assert result["differing_masked_rows"] == result["differing_logprob_bits"] == 0, record


def test_weight_push_script_dry_run(tmp_path: Path) -> None:
    """weight_buckets' GPU record through the colocated stand-in: both variants push in one process, the bucketed one
    in fewer load_weights calls, and the engine's weights after each variant's last push (into NaN) are bit for bit
    the same, and the trainer's."""
    report, stdout = _run(GPU / "weight_push.py", tmp_path / "push.json", "--stand-in", "--tiny", "--repeat", "2")
    off, on = report["variants"]["off"], report["variants"]["on"]
    assert off["fix_state"] == "disabled" and on["fix_state"] == "applied" and on["aside_reason"] is None, on
    for result in (off, on):
        assert result["pushes"] == 2 + 2 and len(result["push_s"]) == 2 and result["push_s_best"] > 0, result
        assert result["tensors_per_push"] == report["parameters"] > 0
        assert result["verification_push_poisoned_parameters"] == report["parameters"]
        assert result["engine_parameters_not_finite_count"] == 0
        versus = result["engine_vs_trainer"]
        assert versus["tensors_exact"] == versus["tensors_compared"] == report["parameters"], versus
    assert off["load_weights_calls"] == report["parameters"] and on["load_weights_calls"] < off["load_weights_calls"]
    assert on["verification_push_load_weights_calls"] == on["load_weights_calls"]
    weights = report["engine_weights"]
    assert weights["identical"] and weights["parameters"]["compared"] == report["parameters"], weights
    assert report["ratio_off_on_best"] > 0 and "ratio off/on" in stdout and "bit-identical" in stdout
