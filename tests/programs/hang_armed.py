"""A process that arms the rollout watchdog and then hangs in a way that makes the report hard to write.

usage: hang_armed.py OUTPUT_DIR LIMIT_SECONDS
  HANG=sleep        time.sleep forever (the GIL is free)     HANG=gil   a C sleep that holds the GIL (ctypes.PyDLL)
  STDERR=keep       as started                               STDERR=none      sys.stderr = None
  STDERR=tee        a tee object without fileno              STDERR=full      fd 2 is a pipe filled to the brim
  REPORT=file       the report file is writable              REPORT=blocks    it is a FIFO: open() never returns,
                                                                              as on a hung network filesystem
Writes OUTPUT_DIR/hang_started (time.time()) just before the hang; the hang is an engine hang (``watch: engine-step``).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
import time
from pathlib import Path

from trl_vlm_fixes.patches.watchdog.timer import WATCHDOG, HangContext


class Tee:
    """A user's stderr replacement: write and flush only."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, text: str) -> int:
        with open(self.path, "a") as handle:
            return handle.write(text)

    def flush(self) -> None:
        return None


def fill_stderr_pipe() -> None:
    flags = fcntl.fcntl(2, fcntl.F_GETFL)
    fcntl.fcntl(2, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        while True:
            os.write(2, b"x" * 4096)
    except BlockingIOError:
        pass
    finally:
        fcntl.fcntl(2, fcntl.F_SETFL, flags)


def main() -> None:
    output_dir, limit = Path(sys.argv[1]), float(sys.argv[2])
    if os.environ.get("REPORT") == "blocks":
        os.mkfifo(output_dir / "trl_vlm_fixes_hang_rank0.txt")
    context = HangContext(
        what="a test hang",
        rank=0,
        step=7,
        output_dir=str(output_dir),
        engine_settings="-",
        likely_cause="a test",
        watch="engine-step",  # an engine without progress: the hang raises the protection state's level
    )
    stderr = os.environ.get("STDERR", "keep")
    if stderr == "none":
        sys.stderr = None  # type: ignore[assignment]
    elif stderr == "tee":
        sys.stderr = Tee(output_dir / "tee.txt")  # type: ignore[assignment]
    WATCHDOG.arm(limit, lambda: context)
    if stderr == "full":
        fill_stderr_pipe()
    (output_dir / "hang_started").write_text(str(time.time()))
    if os.environ.get("HANG") == "gil":
        pydll = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call; CDLL would release it
        while True:
            pydll.sleep(3600)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
