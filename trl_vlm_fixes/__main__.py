"""``trl-vlm-fixes`` (also ``python -m trl_vlm_fixes``): ``status [--json] [--strict]``, ``selftest [--json]``,
``run -- COMMAND...``. A bare ``trl-vlm-fixes`` (or only ``--json``/``--strict``) means ``status``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

# what the self-test imports (module name, pip name)
SELFTEST_NEEDS = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("trl", "trl"),
    ("accelerate", "accelerate"),
    ("datasets", "datasets"),
    ("PIL", "pillow"),
)
COMMANDS = ("status", "selftest", "run")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="trl-vlm-fixes", description="Fixes for Qwen3.5 VLM GRPO training on TRL 1.9.1 + vLLM 0.25.1."
    )
    commands = parser.add_subparsers(dest="command")
    status = commands.add_parser("status", help="the state of every fix (default)")
    status.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    status.add_argument("--strict", action="store_true", help="exit 1 when an enabled fix was skipped")
    selftest = commands.add_parser("selftest", help="show each bug and each fix on the installed stack")
    selftest.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    run = commands.add_parser("run", help="run COMMAND with the fixes in every Python process it starts")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["status", *argv]
    return parser.parse_args(argv)


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
    if args.command == "run":
        from .launcher import run

        return run(args.argv)
    if args.command == "selftest":
        missing = missing_packages()
        if missing:
            print(
                f"trl_vlm_fixes selftest: {', '.join(missing)} not installed; it builds a tiny model and runs TRL "
                f"on it. Install with: pip install {' '.join(missing)}",
                file=sys.stderr,
            )
            return 2
        from .selftest.runner import run_selftest

        return run_selftest(as_json=args.json)
    from . import REGISTRY, status
    from .status import render_table

    REGISTRY.import_targets()
    report = status()
    print(json.dumps(report, indent=2) if args.json else render_table(report))
    if args.strict and any(patch["state"] == "skipped" for patch in report["patches"].values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
