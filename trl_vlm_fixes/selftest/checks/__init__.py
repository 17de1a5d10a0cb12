"""One self-test check per fix (``<fix name>.py``, its ``check(context, family) -> CheckResult``), named by the fix's
declaration as a reference (``Fix(selftest="trl_vlm_fixes.selftest.checks.<name>:check")``) that the runner resolves
only when the self-test runs: a fix never imports the harness; a check imports what it needs of its fix."""
