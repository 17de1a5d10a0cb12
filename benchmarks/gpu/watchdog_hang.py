"""The rollout watchdog against a real GPU hang: the main thread waits in ``torch.cuda.synchronize()`` behind a Triton
kernel that spins on a flag nobody sets. SIGTERM does nothing (the process has a Python SIGTERM handler, as trainers
do, and the main thread never returns to Python); the watchdog ends the process with exit code 75.
    PYTHONPATH=.:$SITE python benchmarks/gpu/watchdog_hang.py --limit 15 --out watchdog_hang.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(limit: float, output_dir: str) -> None:
    import torch
    import triton
    import triton.language as tl

    from trl_vlm_fixes.patches.watchdog.timer import WATCHDOG, HangContext

    @triton.jit
    def spin(flag_ptr):  # type: ignore[no-untyped-def]
        while tl.load(flag_ptr, volatile=True) == 0:
            pass

    signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM handler ran", flush=True))
    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    context = HangContext(
        what="torch.cuda.synchronize() behind a spinning Triton kernel",
        rank=0,
        step=0,
        output_dir=output_dir,
        engine_settings="(no engine: a bare kernel)",
        likely_cause="a GPU kernel that never finishes",
    )
    WATCHDOG.arm(limit, lambda: context)
    spin[(1,)](flag)
    print("LAUNCHED", time.time(), flush=True)
    torch.cuda.synchronize()
    print("synchronize returned (unexpected)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=float, default=15)
    parser.add_argument("--out", default="watchdog_hang.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.limit, args.child)
        return
    output_dir = tempfile.mkdtemp()
    process = subprocess.Popen(
        [sys.executable, __file__, "--limit", str(args.limit), "--child", output_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    launched = None
    for line in process.stdout:
        if line.startswith("LAUNCHED"):
            launched = float(line.split()[1])
            break
    result: dict = {"limit_s": args.limit, "launched": launched is not None}
    if launched is not None:
        time.sleep(3)
        process.send_signal(signal.SIGTERM)
        time.sleep(3)
        result["alive_3s_after_sigterm"] = process.poll() is None
    returncode = process.wait(timeout=args.limit + 60)
    stdout, stderr = process.communicate()
    result["exit_code"] = returncode
    result["seconds_from_launch_to_exit"] = round(time.time() - launched, 1) if launched else None
    result["sigterm_handler_ran"] = "SIGTERM handler ran" in stdout
    report = Path(output_dir) / "trl_vlm_fixes_hang_rank0.txt"
    result["report_written"] = report.exists()
    result["report_head"] = report.read_text()[:600] if report.exists() else stderr[-600:]
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
