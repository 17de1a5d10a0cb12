"""Run a snippet in a fresh interpreter, so import order and environment switches are tested for real.

The snippet is written to a file (so ``inspect.getsource`` works on what it defines). ``with_vllm=False`` hides
vLLM from that interpreter: the patching mechanics do not depend on it and its import costs ~6 s per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

PRELUDE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
"""
HIDE_VLLM = "sys.modules['vllm'] = None\n"


def environment_without_switches() -> dict[str, str]:
    """This process's environment minus every TRL_VLM_FIXES* switch: a child starts from the defaults."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TRL_VLM_FIXES")}


def run_python(
    code: str = "", env: dict[str, str] | None = None, args: list[str] | None = None, with_vllm: bool = False
) -> subprocess.CompletedProcess:
    environment = {**environment_without_switches(), **(env or {})}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(PRELUDE + ("" if with_vllm else HIDE_VLLM) + textwrap.dedent(code))
    command = [sys.executable, *(args or [script.name])]
    try:
        return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(script.name)


def last_json(result: subprocess.CompletedProcess) -> Any:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
