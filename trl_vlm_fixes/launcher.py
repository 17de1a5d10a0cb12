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
# the Python that ran the launcher (it has the plugin): the bootstrap names it when COMMAND's Python lacks the plugin
LAUNCHER_VARIABLE = "TRL_VLM_FIXES_LAUNCHER"


def launch_environment(environment: dict[str, str]) -> dict[str, str]:
    """The environment COMMAND runs in: the bootstrap folder first on PYTHONPATH, once, and every other entry as given.

    An empty entry stays: Python reads it as the current directory (a reward module beside the config imports from
    there). An unset or empty PYTHONPATH adds no entry, so none is made up. The bootstrap folder is recognised by its
    real path, so a symlinked copy of it is not added twice.
    """
    given = environment.get("PYTHONPATH", "")
    bootstrap = os.path.realpath(BOOTSTRAP)
    entries = given.split(os.pathsep) if given else []
    kept = [entry for entry in entries if not entry or os.path.realpath(entry) != bootstrap]
    return {**environment, "PYTHONPATH": os.pathsep.join([str(BOOTSTRAP), *kept]), LAUNCHER_VARIABLE: sys.executable}


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
