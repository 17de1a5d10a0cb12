"""``trl-vlm-fixes`` (also ``python -m trl_vlm_fixes``): ``status [--json] [--strict]
[--model PATH [--mode colocate|server|none] [--sleep-mode]]``, ``selftest [--json] [--only NAME[,NAME]] [-v]``,
``run -- COMMAND...``.
A bare ``trl-vlm-fixes`` (or only ``--json``/``--strict``) means ``status``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import Any

from .declaration import MODES

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
    status.add_argument(
        "--model",
        metavar="PATH",
        help="a checkpoint (folder or cached Hub id): which fixes will act for it, and why not",
    )
    status.add_argument(
        "--mode", choices=MODES, default="colocate", help="with --model: TRL's vllm_mode, or none (use_vllm off)"
    )
    status.add_argument("--sleep-mode", action="store_true", help="with --model: vllm_enable_sleep_mode=True")
    selftest = commands.add_parser("selftest", help="show each bug and each fix on the installed stack")
    selftest.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    selftest.add_argument(
        "--only", metavar="NAME[,NAME]", help="run these fixes' checks alone (an unknown name lists the valid ones)"
    )
    selftest.add_argument(
        "-v", "--verbose", action="store_true", help="show what the libraries print, and each check as it ends"
    )
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

        only = None if args.only is None else [name.strip() for name in args.only.split(",") if name.strip()]
        return run_selftest(as_json=args.json, only=only, verbose=args.verbose)
    from . import status
    from .registry import active
    from .status import render_table

    config = None
    if args.model is not None:  # read before TRL and vLLM are imported: a wrong path is said at once
        from .model_facts import read_config

        try:
            config = read_config(args.model)
        except (OSError, ValueError) as error:
            print(f"trl_vlm_fixes status --model: cannot read {args.model}'s config: {error}", file=sys.stderr)
            return 2
    active().import_targets()
    report = status()
    if config is not None:
        return _status_of_model(args, config, report)
    print(json.dumps(report, indent=2) if args.json else render_table(report))
    if args.strict and any(patch["state"] == "skipped" for patch in report["patches"].values()):
        return 1
    return 0


def _status_of_model(args: argparse.Namespace, config: dict[str, Any], installed: dict[str, Any]) -> int:
    """``status --model PATH``: each fix's verdict for that checkpoint (its ``config``) and mode (the states already
    final)."""
    from . import applicability
    from .status import render_applicability

    report = {**applicability(config, args.mode, args.sleep_mode), "model": str(args.model)}
    keys = ("version", "activation", "versions", "validated")
    print(
        json.dumps({**{k: installed[k] for k in keys}, **report}, indent=2)
        if args.json
        else render_applicability(report)
    )
    skipped = any(fix["reason"].startswith("skipped:") for fix in report["fixes"].values())
    return 1 if args.strict and skipped else 0


if __name__ == "__main__":
    sys.exit(main())
