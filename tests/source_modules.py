"""Import a module written from source text in a test (a modified copy of TRL's code), and forget it afterwards."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType


@contextmanager
def module_from_source(directory: Path, name: str, source: str) -> Iterator[ModuleType]:
    path = directory / f"{name}.py"
    path.write_text(source)  # a real file, so inspect.getsource (and the AST guards) can read it
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]
