"""Loaded first by every Python process that ``trl-vlm-fixes run -- COMMAND`` starts (children included).

The launcher puts this folder first on ``PYTHONPATH``, as ddtrace-run and opentelemetry-instrument do: Python imports
``sitecustomize`` at start-up, so the fixes attach before the program imports TRL. A ``sitecustomize`` that was
already on the path is found and run afterwards, once: every trl_vlm_fixes bootstrap folder on the path (another
installation's launcher nested in this one's, or the reverse) is passed over, so none runs another and the user's
runs once. A failure to load the fixes is one line on stderr and the program
runs without them; with TRL_VLM_FIXES_STRICT=1 the same line ends the process with exit status 1. It must end it
with ``os._exit``: site.py prints and swallows any ``Exception`` from here, and a ``SystemExit`` becomes a fatal
"Failed to import the site module" with a traceback.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
_LAUNCHER_VARIABLE = "TRL_VLM_FIXES_LAUNCHER"  # launcher.LAUNCHER_VARIABLE (the plugin may be missing here)
_STRICT_EXIT = 1


def _strict() -> bool:
    return os.environ.get("TRL_VLM_FIXES_STRICT", "").strip().lower() in ("1", "true", "yes", "on")


def _install_command() -> str:
    """How to install the plugin into this Python: from the checkout this bootstrap lives in, if it is one."""
    checkout = os.path.dirname(os.path.dirname(_HERE))
    source = checkout if os.path.isfile(os.path.join(checkout, "pyproject.toml")) else "trl_vlm_fixes"
    return f"{sys.executable} -m pip install {source}"


def _problem(error: BaseException) -> str:
    """What went wrong, in which Python, and the fix: one sentence."""
    if not isinstance(error, ModuleNotFoundError):
        return f"{sys.executable} could not load the fixes ({type(error).__name__}: {' '.join(str(error).split())})"
    launcher = os.environ.get(_LAUNCHER_VARIABLE, "")
    elsewhere = f", or run the command with the Python that has it ({launcher})" if launcher else ""
    missing = "trl_vlm_fixes" if error.name == "trl_vlm_fixes" else f"{error.name}, which trl_vlm_fixes needs"
    return f"{sys.executable} cannot import {missing}: install the plugin there ({_install_command()}){elsewhere}"


def _activate() -> None:
    try:
        import trl_vlm_fixes

        trl_vlm_fixes.ACTIVATION = "launcher"
    except Exception as error:  # noqa: BLE001 - any failure: one line, then the program without the fixes
        if _strict():
            sys.stderr.write(f"trl_vlm_fixes: {_problem(error)}. TRL_VLM_FIXES_STRICT=1: exiting.\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_STRICT_EXIT)
        sys.stderr.write(
            f"trl_vlm_fixes: {_problem(error)}. Running WITHOUT the fixes (TRL_VLM_FIXES_STRICT=1 stops here).\n"
        )


def _is_bootstrap(entry: str) -> bool:
    """A trl_vlm_fixes bootstrap folder, of this installation or another: ``.../trl_vlm_fixes/bootstrap``."""
    real = os.path.realpath(entry or os.getcwd())
    return real == _HERE or (
        os.path.basename(real) == "bootstrap"
        and os.path.basename(os.path.dirname(real)) == "trl_vlm_fixes"
        and os.path.isfile(os.path.join(real, "sitecustomize.py"))
    )


def _run_the_next_sitecustomize() -> None:
    """The ``sitecustomize`` that would have run without us (a site-wide, virtualenv or user one), if any."""
    ours = sys.modules.pop("sitecustomize", None)
    path = [entry for entry in sys.path if not _is_bootstrap(entry)]
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
