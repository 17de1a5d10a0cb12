"""The protection after a real hang: a GRPO run (TRL 1.9.1, colocate + sleep mode, a small random Qwen3.5 VLM) whose
engine step at ``--wedge-step`` launches a Triton kernel that spins on a flag nobody sets (watchdog_hang.py's) and waits
for it. The watchdog ends the run (exit 75) with its report in ``output_dir``; the restart there (the same command,
as a restart loop runs it) resumes from the last checkpoint, builds its engine ``PIECEWISE`` (read back from the
engine's own config) and trains to the end. Two engine starts in all, with vLLM's compilation (graphs are the subject).
    PYTHONPATH=.:$SITE python benchmarks/gpu/hang_restart.py --out hang_restart.json
    # dry run on the CPU (the engine stand-in; the wedge is a sleep there):
    python benchmarks/gpu/hang_restart.py --stand-in --tiny --out /tmp/h.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import build_grpo_trainer, build_tiny_vlm, engine_cudagraph_mode, run_in_fresh_process, use_engine


def wedge(stand_in: bool) -> None:
    """What a wedged kernel does to the engine step: it never returns."""
    if stand_in:
        while True:
            time.sleep(3600)
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def spin(flag_ptr):  # type: ignore[no-untyped-def]
        while tl.load(flag_ptr, volatile=True) == 0:
            pass

    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    spin[(1,)](flag)
    torch.cuda.synchronize()


def child(model_dir: str, output_dir: str, steps: int, wedge_step: int, stand_in: bool) -> None:
    """One run: the trainer (its engine built as the plugin decides from output_dir), then train(); records each
    rollout's step; the engine step of the first rollout at ``wedge_step`` wedges, in the first run only."""
    import logging

    from transformers.trainer_utils import SaveStrategy

    import trl_vlm_fixes  # noqa: F401 - the plugin under test

    # the engine line of a healthy build is INFO: the plugin's logger at INFO, each line as its message alone
    logging.basicConfig(format="%(message)s")
    logging.getLogger("trl_vlm_fixes").setLevel(logging.INFO)
    use_engine(stand_in)
    records = Path(output_dir) / "hang_restart_records.jsonl"

    def record(event: str, **fields: Any) -> None:
        with open(records, "a") as handle:
            handle.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")

    trainer = build_grpo_trainer(Path(model_dir), output_dir, steps, stand_in, max_completion_length=16)
    trainer.args.save_strategy, trainer.args.save_steps = SaveStrategy.STEPS, 1  # a checkpoint to resume from
    llm = trainer.vllm_generation.llm
    record(
        "start",
        built_mode=engine_cudagraph_mode(llm),
        compilation_config=str(getattr(llm, "init_kwargs", {}).get("compilation_config", "(real engine)")),
    )
    engine, marker = llm.llm_engine, Path(output_dir) / "wedged"
    step = engine.step

    def wedging_step(*args: Any, **kwargs: Any) -> Any:
        if trainer.state.global_step == wedge_step and not marker.exists():
            marker.write_text(str(time.time()))
            record("wedged", step=trainer.state.global_step)
            wedge(stand_in)
        return step(*args, **kwargs)

    engine.step = wedging_step
    generate = llm.generate

    def recorded_generate(*args: Any, **kwargs: Any) -> Any:
        record("generate", step=trainer.state.global_step)
        return generate(*args, **kwargs)

    llm.generate = recorded_generate
    trainer.train()
    record("end", step=trainer.state.global_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--wedge-step", type=int, default=1, help="the trainer's global_step whose rollout wedges")
    parser.add_argument("--limit", default="20", help="TRL_VLM_FIXES_WATCHDOG (seconds without an engine step)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=560, help="seconds per run")
    parser.add_argument("--stand-in", action="store_true", help="the CPU engine stand-in (a dry run)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny shape")
    parser.add_argument("--out", default="hang_restart.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model_dir, args.child, args.steps, args.wedge_step, args.stand_in)
        return
    from common import build_random_qwen35

    base = Path(tempfile.mkdtemp())
    model_dir = (
        build_tiny_vlm(base / "model") if args.tiny else build_random_qwen35(base / "model", args.hidden, args.layers)
    )
    output_dir = base / "out"
    output_dir.mkdir()
    report: dict[str, Any] = {"steps": args.steps, "wedge_step": args.wedge_step, "limit_s": args.limit, "runs": []}
    command = [__file__, "--child", str(output_dir), "--model-dir", str(model_dir), "--steps", str(args.steps)]
    command += ["--wedge-step", str(args.wedge_step)] + (["--stand-in"] if args.stand_in else [])
    env = {**os.environ, "TRL_VLM_FIXES_WATCHDOG": args.limit}
    for attempt in ("hung", "restarted"):
        started = time.monotonic()
        _, run = run_in_fresh_process(command, timeout=args.timeout, env=env)
        entry: dict[str, Any] = {"attempt": attempt, "seconds": round(time.monotonic() - started, 1)}
        entry["exit_code"] = run.returncode if run else "timed out"
        entry["engine_lines"] = [line for line in (run.stderr if run else "").splitlines() if "built the" in line]
        report["runs"].append(entry)
        Path(args.out).write_text(json.dumps(report, indent=2))
    records = [json.loads(line) for line in (output_dir / "hang_restart_records.jsonl").read_text().splitlines()]
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for entry in records:
        by_pid.setdefault(entry["pid"], []).append(entry)
    for run_entry, events in zip(report["runs"], by_pid.values(), strict=False):
        start = next((e for e in events if e["event"] == "start"), {})
        run_entry["built_mode"], run_entry["compilation_config"] = (
            start.get("built_mode"),
            start.get("compilation_config"),
        )
        run_entry["rollout_steps"] = [e["step"] for e in events if e["event"] == "generate"]
        run_entry["end_step"] = next((e["step"] for e in events if e["event"] == "end"), None)
    hang_reports = sorted(output_dir.glob("trl_vlm_fixes_hang_rank0*.txt"))
    report["hang_report_head"] = hang_reports[0].read_text()[:1500] if hang_reports else None
    hung, restarted = (report["runs"] + [{}, {}])[:2]
    report["verdict"] = {
        "hung_run_exit_75": hung.get("exit_code") == 75,
        "hung_run_mode": hung.get("built_mode"),
        "restart_mode": restarted.get("built_mode"),
        "restart_resumed_at_wedge_step": (restarted.get("rollout_steps") or [None])[0] == args.wedge_step,
        "restart_trained_to_the_end": restarted.get("end_step") == args.steps,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report["verdict"], indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
