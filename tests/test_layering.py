"""The layering of the plugin's own source: the core below the fixes, the self-test beside them.

The harness (``trl_vlm_fixes/selftest/``) may import the fixes and the core; no fix (``patches/``) and no core module
imports the harness, so ``import trl_vlm_fixes`` never loads it and no import circle joins a fix and the harness. A
fix names its check (``Fix.selftest = "module:function"``), which the self-test resolves when it runs. No core module
imports a fix (``__init__`` aside, which imports the list of fixes, ``patches/__init__.py``, and the CLI): the core
reads what it needs of a fix from its declaration, through the registry (``registry.active()``, the package's one way
to reach it); and the package's import graph has no cycle at all, inside functions included.

Checked twice: in a fresh interpreter (what ``import trl_vlm_fixes`` leaves in ``sys.modules``), and statically over
the source, every ``import`` / ``from ... import`` statement (module level and inside functions, relative ones
resolved) and every ``importlib.import_module("...")`` with a constant name. Each check is also run on a copy of the
package with a harness import put back into one fix, or a fix import and a ``from . import REGISTRY`` put back into the
core, to show that it fails there.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import trl_vlm_fixes
from trl_vlm_fixes.patches import ALL_FIXES

pytestmark = pytest.mark.stack_independent  # the plugin's own source and its import: no TRL/transformers/vLLM code

PACKAGE = "trl_vlm_fixes"
HARNESS = f"{PACKAGE}.selftest"
FIXES = f"{PACKAGE}.patches"
# The one module outside the harness allowed to import it: the CLI, whose ``selftest`` command is the harness's entry
# point (inside ``main``; ``import trl_vlm_fixes`` never imports ``__main__``).
HARNESS_ENTRY_POINTS = {(f"{PACKAGE}.__main__", f"{HARNESS}.runner")}
# The core's imports of the fixes allowed: ``__init__`` imports the list of fixes (``patches/__init__.py``); the CLI
# (``__main__``, which ``import trl_vlm_fixes`` never loads) is left out of the check.
CORE_IMPORTS_OF_FIXES = {(PACKAGE, FIXES)}
CLI = f"{PACKAGE}.__main__"


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    deferred: bool  # inside a function (run when called), not at the module's import


def modules_of(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` (the folder holding ``__init__.py``), by dotted name."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(root: Path) -> list[Import]:
    """Every import of a module of the package by a module of the package (third-party ones left out): ``import a.b``
    names ``a.b``; ``from a import b`` names ``a.b`` where that is a module, else ``a``."""
    modules = modules_of(root)
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, deferred in _walk(tree, deferred=False):
            for imported in _named(node, package):
                if imported.split(".")[0] != PACKAGE:
                    continue
                while imported not in modules:  # a name inside a module, or a module missing from this copy
                    imported = imported.rpartition(".")[0]
                found.append(Import(name, imported, node.lineno, deferred))
    return found


def _walk(node: ast.AST, deferred: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        yield child, deferred
        inside = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inside)


def _named(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = package.split(".")
        if node.level:
            base = base[: len(base) - (node.level - 1)]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        return [f"{module}.{alias.name}" for alias in node.names if alias.name != "*"] or [module]
    if (  # importlib.import_module("trl_vlm_fixes.selftest...") / import_module(...) with a constant name
        isinstance(node, ast.Call)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) in ("import_module", "__import__")
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and not node.args[0].value.startswith(".")
    ):
        return [node.args[0].value]
    return []


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _said(i: Import) -> str:
    """One import, as a line of a failure message."""
    return f"{i.importer} (line {i.line}{', in a function' if i.deferred else ''}) imports {i.imported}"


def harness_imports_outside_the_harness(root: Path) -> list[str]:
    return [
        _said(i)
        for i in imports_of(root)
        if _under(i.imported, HARNESS)
        and not _under(i.importer, HARNESS)
        and (i.importer, i.imported) not in HARNESS_ENTRY_POINTS
    ]


def core_imports_of_fixes(root: Path) -> list[str]:
    """The imports of a module under ``patches/`` by a core module (neither a fix nor the harness), as lines."""
    return [
        _said(i)
        for i in imports_of(root)
        if _under(i.imported, FIXES)
        and not _under(i.importer, FIXES)
        and not _under(i.importer, HARNESS)
        and i.importer != CLI
        and (i.importer, i.imported) not in CORE_IMPORTS_OF_FIXES
    ]


def cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), sorted (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for importer, imported in edges:
        graph.setdefault(importer, set()).add(imported)
        graph.setdefault(imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def fix_and_harness_cycles(root: Path) -> list[list[str]]:
    """Cycles of the import graph between the modules under ``patches/`` and ``selftest/``."""
    inside = [(i.importer, i.imported) for i in imports_of(root)]
    kept = (FIXES, HARNESS)
    return cycles([(a, b) for a, b in inside if any(_under(a, p) for p in kept) and any(_under(b, p) for p in kept)])


def package_cycles(root: Path) -> list[list[str]]:
    """Cycles of the whole package's import graph (the modules a statement names; a package's ``__init__`` that a
    submodule's import runs first is not an edge)."""
    return cycles([(i.importer, i.imported) for i in imports_of(root)])


def harness_modules_after_import(root: Path | None = None) -> list[str]:
    """``import trl_vlm_fixes`` in a fresh interpreter (``python -c``; the copy under ``root`` first on the path, if
    given): the harness modules it leaves in ``sys.modules``."""
    code = (
        "import json, sys\n"
        + (f"sys.path.insert(0, {str(root.parent)!r})\n" if root is not None else "")
        + "import trl_vlm_fixes\n"
        + (f"assert trl_vlm_fixes.__file__.startswith({str(root)!r}), trl_vlm_fixes.__file__\n" if root else "")
        + f"print(json.dumps(sorted(m for m in sys.modules if m == {HARNESS!r} or m.startswith({HARNESS + '.'!r}))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


INSTALLED = Path(trl_vlm_fixes.__file__).parent


@pytest.fixture
def harness_imported_by_a_fix(tmp_path: Path) -> Path:
    """A copy of the package whose ``reload_skip`` imports the harness again, as the fixes' checks did (at module
    level: ``import trl_vlm_fixes`` loads it; and inside a function: only the static check sees that one)."""
    root = tmp_path / PACKAGE
    shutil.copytree(INSTALLED, root, ignore=shutil.ignore_patterns("__pycache__"))
    fix = root / "patches" / "reload_skip.py"
    text = fix.read_text()
    anchor = "from .. import metrics\n"
    assert anchor in text
    fix.write_text(
        text.replace(anchor, anchor + "from ..selftest import runner as _runner  # noqa: F401\n", 1)
        + "\n\ndef _check() -> None:\n    from ..selftest.rollout_schedule import build_generation  # noqa: F401\n"
    )
    return root


@pytest.fixture
def fix_imported_by_the_core(tmp_path: Path) -> Path:
    """A copy of the package whose core reaches a fix and the registry as it did: ``trainer_start`` imports the
    watchdog and ``metrics`` the package's ``REGISTRY``, each inside a function."""
    root = tmp_path / PACKAGE
    shutil.copytree(INSTALLED, root, ignore=shutil.ignore_patterns("__pycache__"))
    for module, function, statement in (
        ("trainer_start.py", "def _after_init(", "from .patches.watchdog import register_owner"),
        ("metrics.py", "def declared(", "from . import REGISTRY"),
    ):
        path = root / module
        text = path.read_text()
        assert function in text
        path.write_text(text + f"\n\ndef _put_back() -> None:\n    {statement}  # noqa: F401\n")
    return root


def test_importing_the_plugin_loads_no_harness_module() -> None:
    assert harness_modules_after_import() == []


def test_a_harness_import_in_a_fix_is_seen_at_import(harness_imported_by_a_fix: Path) -> None:
    loaded = harness_modules_after_import(harness_imported_by_a_fix)
    assert f"{HARNESS}.runner" in loaded, loaded


def test_no_fix_and_no_core_module_imports_the_harness() -> None:
    assert harness_imports_outside_the_harness(INSTALLED) == []


def test_no_import_cycle_joins_a_fix_and_the_harness() -> None:
    edges = {(i.importer, i.imported) for i in imports_of(INSTALLED)}
    assert (f"{HARNESS}.rollout_schedule", f"{FIXES}.reload_skip") in edges  # harness -> fix: allowed, and seen
    assert fix_and_harness_cycles(INSTALLED) == []


def test_the_static_checks_see_a_harness_import_in_a_fix(harness_imported_by_a_fix: Path) -> None:
    found = harness_imports_outside_the_harness(harness_imported_by_a_fix)
    assert any(f"{FIXES}.reload_skip (line " in line and line.endswith(f") imports {HARNESS}.runner") for line in found)
    assert any(line.endswith(f", in a function) imports {HARNESS}.rollout_schedule") for line in found), found
    assert [f"{FIXES}.reload_skip", f"{HARNESS}.rollout_schedule"] in fix_and_harness_cycles(harness_imported_by_a_fix)


def test_the_package_import_graph_has_no_cycle() -> None:
    """No cycle in the whole package's graph, imports inside functions included: the core reaches the registry as
    ``registry.active()`` (never ``from . import REGISTRY``) and a fix's facts through its declaration."""
    imports = imports_of(INSTALLED)
    assert any(i.deferred for i in imports)  # the imports inside functions are in the graph
    assert package_cycles(INSTALLED) == []


def test_no_core_module_imports_a_fix() -> None:
    edges = {(i.importer, i.imported) for i in imports_of(INSTALLED)}
    assert (PACKAGE, FIXES) in edges  # __init__ -> the list of fixes: allowed, and seen
    assert (f"{FIXES}.gdn_prefill", f"{PACKAGE}.registry") in edges  # fix -> core: allowed, and seen
    assert core_imports_of_fixes(INSTALLED) == []


def test_the_static_checks_see_a_fix_import_and_a_registry_import_in_the_core(fix_imported_by_the_core: Path) -> None:
    found = core_imports_of_fixes(fix_imported_by_the_core)
    assert [line for line in found if line.endswith(f", in a function) imports {FIXES}.watchdog")], found
    assert all(line.startswith(f"{PACKAGE}.trainer_start (line ") for line in found), found
    found_cycles = package_cycles(fix_imported_by_the_core)
    assert [cycle for cycle in found_cycles if {PACKAGE, f"{PACKAGE}.metrics"} <= {*cycle}], found_cycles


def test_relative_imports_resolve_to_the_modules_they_name() -> None:
    imported = {(i.importer, i.imported) for i in imports_of(INSTALLED)}
    assert (f"{FIXES}.cudagraph", f"{PACKAGE}.protection") in imported  # from .. import protection
    assert (f"{FIXES}", f"{FIXES}.watchdog") in imported  # from . import (..., watchdog)
    assert (f"{HARNESS}.checks.wake_reset", f"{PACKAGE}.registry") in imported  # from ...registry import active
    assert (f"{HARNESS}.runner", PACKAGE) in imported  # from .. import apply, revert, inside off_then_on()


def test_every_declared_check_resolves_in_the_harness_to_a_function() -> None:
    from trl_vlm_fixes.selftest.runner import resolve_check

    declared = {fix.name: fix.selftest for fix in ALL_FIXES if fix.selftest is not None}
    assert declared == {name: f"{HARNESS}.checks.{name}:check" for name in declared}  # one module per fix
    for name in declared:
        assert callable(resolve_check(name))


def test_a_check_that_does_not_resolve_says_which_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from trl_vlm_fixes import REGISTRY
    from trl_vlm_fixes.declaration import Fix
    from trl_vlm_fixes.selftest.runner import CheckReferenceError, resolve_check

    fix = REGISTRY.fixes["gdn_prefill"]
    for reference, why in (
        (f"{HARNESS}.checks.nope:check", f"no module '{HARNESS}.checks.nope'"),
        (f"{HARNESS}.checks.gdn_prefill:nope", f"module '{HARNESS}.checks.gdn_prefill' has no 'nope'"),
        (f"{HARNESS}.checks.mm_realign:INVARIANCE_TOLERANCE", "'INVARIANCE_TOLERANCE' is a float, not a function"),
    ):
        monkeypatch.setitem(REGISTRY.fixes, "gdn_prefill", dataclasses.replace(fix, selftest=reference))
        with pytest.raises(CheckReferenceError) as error:
            resolve_check("gdn_prefill")
        assert f"fix gdn_prefill's self-test check {reference!r} does not resolve: {why}" in str(error.value)
    with pytest.raises(TypeError, match="name the check as 'module:function'"):
        dataclasses.replace(fix, selftest=print)  # type: ignore[arg-type]  # the function itself, as before
    with pytest.raises(TypeError, match="name the check"):
        Fix(name="x", summary="", packages=(), targets=(), selftest="no colon")
