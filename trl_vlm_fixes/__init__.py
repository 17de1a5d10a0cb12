"""trl_vlm_fixes: ``import trl_vlm_fixes`` fixes the TRL 1.9.1 + vLLM 0.25.1 bugs of Qwen3.5 VLM GRPO training.

Importing this package imports neither torch, trl, transformers nor vllm: each fix attaches when its target module
is imported (wrapt post-import hooks), so the import order does not matter.
"""

from __future__ import annotations

from typing import Any

from . import trainer_start
from .applicability import applicability as _applicability
from .metrics import support_targets
from .patches import ALL_FIXES, ExpertLayoutError
from .registry import FixNotApplicableError, Registry
from .server_flags import advise_trl_server
from .status import build_status
from .switches import SwitchValueError

__version__ = "0.2.0"
# earlier names of SwitchValueError (a user's ``except trl_vlm_fixes.CudagraphModeError`` keeps working)
CudagraphModeError = GdnPrefillBackendError = SwitchValueError
# how the plugin was activated: "import" (the one-line import) or "launcher" (trl-vlm-fixes run, set by its bootstrap)
ACTIVATION: str = globals().get("ACTIVATION", "import")
__all__ = [
    "CudagraphModeError",
    "ExpertLayoutError",
    "FixNotApplicableError",
    "GdnPrefillBackendError",
    "SwitchValueError",
    "__version__",
    "applicability",
    "apply",
    "revert",
    "status",
]

# One registry per process, kept across importlib.reload so that a reload never wraps anything twice. The package
# reaches it as ``registry.active()``; this name is the public API's (the tests', the examples').
REGISTRY: Registry = globals().get("REGISTRY") or Registry(
    ALL_FIXES, support=support_targets() + trainer_start.support_targets(__version__)
)


def apply(**fixes: bool | dict[str, Any]) -> None:
    """Turn on every fix the environment switches allow; a second call changes nothing.

    Explicit choices win over the environment, as ddtrace's ``patch(**modules)``: ``apply(watchdog=False)`` turns one
    fix off, ``apply(cudagraph={"mode": "NONE"})`` sets a fix's setting (the names are in README's switch table).
    Every switch and setting is read now; a bad value raises at once, naming it."""
    REGISTRY.apply(fixes)


def revert(*names: str) -> None:
    """Restore TRL's original methods exactly (of the named fixes only, if any are named; the others stay applied).
    ``apply()`` puts back what ``revert()`` took; a fix reverted by name stays off until ``apply(name=True)``."""
    REGISTRY.revert(names or None)


def status() -> dict[str, Any]:
    """Versions and, per fix, its state (applied, stepped-aside, disabled, skipped, not-needed, or pending until TRL
    is imported)."""
    return build_status(REGISTRY, __version__, ACTIVATION)


def applicability(model: Any, mode: str = "colocate", sleep_mode: bool = False) -> dict[str, Any]:
    """Before a run: for checkpoint ``model`` (a folder, its ``config.json``, a cached Hub id, or the config as a
    dict) and ``mode`` (``colocate``, ``server``, ``none``), each fix's verdict (``will act`` / ``steps aside``) and
    the reason it would log, read from the fixes' declarations (``trl-vlm-fixes status --model``)."""
    return _applicability(model, mode, sleep_mode, REGISTRY)


apply()
advise_trl_server()  # in vLLM's own server exec'd by TRL >= 1.11's `trl vllm-serve`: the flags to pass it
