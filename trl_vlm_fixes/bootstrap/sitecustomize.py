"""Loaded first by every Python process that ``trl-vlm-fixes run -- COMMAND`` starts (children included).

The launcher puts this folder first on ``PYTHONPATH``, as ddtrace-run and opentelemetry-instrument do: Python imports
``sitecustomize`` at start-up, so the fixes attach before the program imports TRL. A ``sitecustomize`` that was
already on the path is found and run afterwards. Nothing here may break the user's program: a failure is reported on
stderr and the program runs without the fixes (unless TRL_VLM_FIXES_STRICT=1 asked for the failure).
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _activate() -> None:
    try:
        import trl_vlm_fixes

        trl_vlm_fixes.ACTIVATION = "launcher"
    except Exception as error:
        if os.environ.get("TRL_VLM_FIXES_STRICT", "").strip().lower() in ("1", "true", "yes", "on"):
            raise
        sys.stderr.write(f"trl_vlm_fixes: the launcher could not load the fixes ({error!r}); running without them.\n")


def _run_the_next_sitecustomize() -> None:
    """The ``sitecustomize`` that would have run without us (a site-wide or virtualenv one), if any."""
    ours = sys.modules.pop("sitecustomize", None)
    path = [entry for entry in sys.path if os.path.abspath(entry or os.getcwd()) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_activate()
_run_the_next_sitecustomize()
