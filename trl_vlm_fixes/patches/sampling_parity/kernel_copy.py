"""vLLM's Triton top-k/top-p kernel on the CPU: its own source, run by Triton's interpreter.

On CUDA, vLLM 0.25.1 sends a sampling step of 8 or more requests (and, with the plugin's engine wrapper, every step)
through ``apply_top_k_top_p_triton``: a pivot search that keeps exactly k tokens at a top-k tie and finds the top-p
cut approximately. No other code computes what it computes, so on a machine without a GPU (the tests, the engine
stand-in, a CPU trainer) the kernel itself runs, in Triton's interpreter (numpy, one program after another).

The copy is vLLM's file, executed in a namespace of its own (vLLM's modules are left alone), with these textual
substitutions, each required to match exactly once:

- ``from vllm.triton_utils import tl, triton``: the real ``triton`` (vLLM's module gives placeholders where it found
  no GPU driver; where it found one it gives exactly these modules);
- ``row_id.to(tl.int64)`` -> ``tl.cast(row_id, tl.int64)``: the same cast (``tensor.to`` is ``cast``), written so that
  the interpreter, whose ``tl.range`` yields Python ints, can run it;
- the tile sizes' device test reads the copy's ``TILES_OF`` instead of the tensor's device: vLLM picks 256/128 for CPU
  tensors and 8192/4096 for CUDA ones, and the pivot search starts from one tile, so the CUDA tiles are what the GPU
  engine computes.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so triton.language's own jit functions
(``tl.sum``, ``tl.zeros``...) are compiled-mode objects in a process that imported triton without it. The interpreter
mode is therefore a block (``interpreting``), around the copy's decoration and around each of its runs: the knob on
(``triton.knobs.runtime.scope`` puts the previous value back) and interpreted twins of those library functions in
place, all restored at the block's end, so the rest of the process sees Triton as it was. The source is written to a
file because the interpreter re-reads each kernel's source with ``inspect``.

The copy is used only on the kernel source it was proven on (``PROVEN_SHA256``, vLLM 0.25.1): another vLLM's kernel
(0.31 adds a split top-p pipeline and warm-up dispatchers) gets no copy, and ``why_no_copy`` says so.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

KERNEL_MODULE = "vllm.v1.sample.ops.topk_topp_triton"
# sha256 of vllm/v1/sample/ops/topk_topp_triton.py in vLLM 0.25.1
PROVEN_SHA256 = "58f7bc2ab7ae0c18f79c41672134b574b7aa8c654ecccaa46655a6962375c68e"
# vLLM's device names for its two tile choices (``apply_top_k_top_p_triton``: "cpu" -> 256/128, "cuda" -> 8192/4096)
CUDA_TILES = "cuda"
CPU_TILES = "cpu"
# one Triton program per streaming multiprocessor, as on an H100/H200 (132 SMs); a row's result does not depend on it
_PROGRAMS = 132
_SUBSTITUTIONS = (
    ("from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl"),
    ("row_id.to(tl.int64)", "tl.cast(row_id, tl.int64)"),
    ('if logits.device.type == "cpu":', 'if TILES_OF(logits.device.type) == "cpu":'),
)
_lock = threading.RLock()

TopKTopP = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]


def _kernel_source() -> tuple[str, str] | str:
    """(path, source) of the installed vLLM's kernel file, or why there is none."""
    try:
        spec = importlib.util.find_spec(KERNEL_MODULE)
    except (ImportError, ValueError) as error:  # vLLM absent (or hidden)
        return f"{KERNEL_MODULE} is not importable ({error!r})"
    if spec is None or spec.origin is None:
        return f"{KERNEL_MODULE} is not installed"
    return spec.origin, Path(spec.origin).read_text()


@functools.cache
def why_no_copy() -> str | None:
    """Why the installed vLLM's kernel cannot run here in Triton's interpreter, or None."""
    try:
        import triton  # noqa: F401 - the interpreter is triton's
    except ImportError as error:
        return f"triton is not importable ({error})"
    found = _kernel_source()
    if isinstance(found, str):
        return found
    path, source = found
    digest = hashlib.sha256(source.encode()).hexdigest()
    if digest != PROVEN_SHA256:
        return f"{path} is not the kernel the interpreter copy was proven on (vLLM 0.25.1's; sha256 {digest[:12]})"
    return None


@functools.cache
def interpreted_top_k_top_p(tiles: str = CUDA_TILES) -> TopKTopP:
    """vLLM's ``apply_top_k_top_p_triton``, run by Triton's interpreter, with the tiles vLLM picks for ``tiles``
    tensors. Raises RuntimeError where ``why_no_copy()`` gives a reason."""
    kernel: TopKTopP = copy_namespace(tiles)["apply_top_k_top_p_triton"]

    def apply_top_k_top_p_triton(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        with interpreting():
            return kernel(logits, k, p)

    return apply_top_k_top_p_triton


@functools.cache
def copy_namespace(tiles: str) -> dict[str, Any]:
    """The executed copy of vLLM's kernel module (its functions, decorated in interpreter mode)."""
    if reason := why_no_copy():
        raise RuntimeError(f"vLLM's Triton top-k/top-p kernel cannot run in the interpreter: {reason}")
    found = _kernel_source()
    assert not isinstance(found, str)  # why_no_copy checked it
    source = found[1]
    for old, new in _SUBSTITUTIONS:
        if source.count(old) != 1:
            raise RuntimeError(f"{KERNEL_MODULE}: {old!r} occurs {source.count(old)} times, not once")
        source = source.replace(old, new)
    directory = Path(tempfile.gettempdir()) / f"trl_vlm_fixes_kernels_{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"topk_topp_triton_{PROVEN_SHA256[:12]}_{tiles}.py"
    if not path.exists() or path.read_text() != source:
        staged = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        staged.write_text(source)
        staged.replace(path)  # atomic: another process reading it sees one whole file
    namespace: dict[str, Any] = {
        "__name__": f"trl_vlm_fixes_interpreted_{tiles}",
        "__file__": str(path),
        "TILES_OF": lambda device_type: tiles,
    }
    with interpreting():
        exec(compile(source, str(path), "exec"), namespace)  # vLLM's own source, checked above
    namespace["num_compute_units"] = lambda device_id=None: _PROGRAMS
    return namespace


@functools.cache
def _library_swaps() -> tuple[tuple[ModuleType, str, Any, Any], ...]:
    """(module, name, compiled, interpreted) for every ``@triton.jit`` function of ``triton.language`` (``tl.sum``,
    ``tl.zeros``, their combine functions...): decorated when triton was imported, they are compiled-mode objects
    unless ``TRITON_INTERPRET`` was set then; the interpreter needs its own."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted: dict[int, Any] = {}
    swaps = []
    for name, module in sorted(sys.modules.items()):
        if not isinstance(module, ModuleType) or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attribute, value in vars(module).items():
            if isinstance(value, JITFunction):
                replacement = interpreted.setdefault(id(value), InterpretedFunction(value.fn))
                swaps.append((module, attribute, value, replacement))
    return tuple(swaps)


@contextmanager
def interpreting() -> Iterator[None]:
    """Triton in interpreter mode, for this thread's block only: the ``TRITON_INTERPRET`` knob (read when
    ``@triton.jit`` decorates and by constexpr functions) and triton.language's own jit functions; both put back.
    The interpreter itself patches ``triton.language`` while a kernel runs, so runs take turns."""
    import triton

    with _lock, triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        swaps = _library_swaps()
        for module, attribute, _, interpreted in swaps:
            setattr(module, attribute, interpreted)
        try:
            yield
        finally:
            for module, attribute, compiled, _ in swaps:
                setattr(module, attribute, compiled)
