"""``python -m trl_vlm_fixes [--json] [--strict]`` and ``python -m trl_vlm_fixes selftest [--json]``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from . import REGISTRY, status
from .status import render_table


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trl_vlm_fixes", description="Status of the trl_vlm_fixes fixes.")
    parser.add_argument("command", nargs="?", choices=["status", "selftest"], default="status")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--strict", action="store_true", help="exit non-zero when an enabled fix was skipped")
    return parser.parse_args(argv)


# what the self-test imports (module name, pip name)
SELFTEST_NEEDS = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("trl", "trl"),
    ("accelerate", "accelerate"),
    ("datasets", "datasets"),
    ("PIL", "pillow"),
)


def missing_packages(needs: tuple[tuple[str, str], ...] = SELFTEST_NEEDS) -> list[str]:
    missing = []
    for module, package in needs:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
            found = False
        if not found:
            missing.append(package)
    return missing


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.command == "selftest":
        missing = missing_packages()
        if missing:
            print(
                f"trl_vlm_fixes selftest: {', '.join(missing)} not installed; it builds a tiny model and runs TRL "
                f"on it. Install with: pip install {' '.join(missing)}",
                file=sys.stderr,
            )
            return 2
        from .selftest import run_selftest

        return run_selftest(as_json=args.json)
    REGISTRY.import_targets()
    report = status()
    print(json.dumps(report, indent=2) if args.json else render_table(report))
    if args.strict and any(patch["state"] == "skipped" for patch in report["patches"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
