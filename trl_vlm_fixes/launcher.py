"""``trl-vlm-fixes run -- COMMAND...``: the fixes for programs nobody can edit (TRL's CLI, accelerate, vllm-serve).

Like ``ddtrace-run`` and ``opentelemetry-instrument``: prepend a bootstrap folder holding a ``sitecustomize.py`` to
``PYTHONPATH`` and exec the command. Every Python process it starts, and every child process those start (accelerate's
ranks, vllm-serve's workers), inherits the variable and imports the plugin first. Switches work as usual.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

BOOTSTRAP = Path(__file__).parent / "bootstrap"
LAUNCHER_VARIABLE = "TRL_VLM_FIXES_LAUNCHER"


def launch_environment(environment: dict[str, str]) -> dict[str, str]:
    """The environment COMMAND runs in: the bootstrap folder first on PYTHONPATH (once), the rest kept."""
    paths = [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOTSTRAP)]
    return {**environment, "PYTHONPATH": os.pathsep.join([str(BOOTSTRAP), *paths]), LAUNCHER_VARIABLE: "1"}


def run(command: list[str]) -> int:
    """Replace this process by COMMAND (returns only when COMMAND cannot be started)."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("trl-vlm-fixes run: no command given. Usage: trl-vlm-fixes run -- COMMAND ...", file=sys.stderr)
        return 2
    executable = shutil.which(command[0])
    if executable is None:
        print(f"trl-vlm-fixes run: command not found: {command[0]!r} (is it installed and on PATH?)", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(executable, command, launch_environment(dict(os.environ)))
    return 126  # not reached: execve replaced this process
