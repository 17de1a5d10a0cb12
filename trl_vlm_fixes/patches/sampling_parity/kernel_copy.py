"""vLLM's Triton top-k/top-p kernel on the CPU: its own source, run by Triton's interpreter.

On CUDA, vLLM 0.25.1 sends a sampling step of 8 or more requests (and, with the plugin's engine wrapper, every step)
through ``apply_top_k_top_p_triton``: a pivot search that keeps exactly k tokens at a top-k tie and finds the top-p
cut approximately. No other code computes what it computes, so on a machine without a GPU (the tests, the engine
stand-in, a CPU trainer) the kernel itself runs, in Triton's interpreter (numpy, one program after another).

The copy is vLLM's file, executed in a namespace of its own (vLLM's modules are left alone), with these textual
substitutions (vLLM 0.25.1's file), each required to match exactly once:

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

vLLM 0.31's file (``PROVEN_SHA256_0_31``) adds a split-row top-p pipeline and warm-up dispatchers (which launch the
kernels with ``kernel[grid](...)``: they run in the interpreter as they are); its copy takes, besides the import and the
``row_id`` cast, the same cast of ``row`` (three times), and reads the device it stands in for through ``TILES_OF`` at
each of vLLM's device tests: the tile choice, the split pipeline's dispatch (a call of at most ``_SPLIT_MAX_BATCH`` rows
with top-p and no top-k on CUDA) and ``current_platform.is_cuda_alike()`` (twice: whether that pipeline covers the
p-only rows of a mixed call, and its warm-up); each must occur as often as ``_SUBSTITUTIONS_0_31`` says. With the CUDA
tiles the copy therefore dispatches as vLLM does on CUDA, with 132 SMs (an H100's; the split of a row across programs
depends on it, ``_topp_split_count``). ``monolithic_top_k_top_p`` launches 0.31's monolithic kernel (``_topk_topp``)
as ``apply_top_k_top_p_triton`` launches it for a call of more than 64 rows, on any rows (vLLM's module on CUDA, the
copy here): the rule the engine wrapper and the trainer apply to top-p alone (``vllm_rule.apply_kernel``).

The copy is used only on the kernel sources it was proven on (``PROVEN``: vLLM 0.25.1's and 0.31.0's files, by sha256):
another vLLM's kernel gets no copy, and ``why_no_copy`` says so.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
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
# sha256 of vllm/v1/sample/ops/topk_topp_triton.py in vLLM 0.31.0
PROVEN_SHA256_0_31 = "c19c0af6a55c72dcb845ca531586faacc987711fc7bf3c5288cc498f923752f4"
# (old, new, occurrences): each must occur exactly that many times
_SUBSTITUTIONS_0_31 = (
    ("from vllm.triton_utils import tl, triton", "import triton\nimport triton.language as tl", 1),
    ("row_id.to(tl.int64)", "tl.cast(row_id, tl.int64)", 1),
    ("row.to(tl.int64)", "tl.cast(row, tl.int64)", 3),
    ('if logits.device.type == "cpu":', 'if TILES_OF(logits.device.type) == "cpu":', 1),
    ('and logits.device.type == "cuda"', 'and TILES_OF(logits.device.type) == "cuda"', 1),
    ("current_platform.is_cuda_alike()", 'TILES_OF("cpu") == "cuda"', 2),
)
# the proven kernel files: sha256 -> (vLLM version, substitutions)
PROVEN: dict[str, tuple[str, tuple[tuple[str, str, int], ...]]] = {
    PROVEN_SHA256: ("0.25.1", tuple((old, new, 1) for old, new in _SUBSTITUTIONS)),
    PROVEN_SHA256_0_31: ("0.31.0", _SUBSTITUTIONS_0_31),
}
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
    digest = _digest(source)
    if digest not in PROVEN:
        versions = " or ".join(f"{version}'s" for version, _ in PROVEN.values())
        return f"{path} is not a kernel the interpreter copy was proven on (vLLM {versions}; sha256 {digest[:12]})"
    return None


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def proven_version() -> str | None:
    """The vLLM version whose kernel file the copy runs ("0.25.1", "0.31.0"), or None where there is no copy."""
    found = _kernel_source()
    if why_no_copy() is not None or isinstance(found, str):
        return None
    return PROVEN[_digest(found[1])][0]


@functools.cache
def interpreted_top_k_top_p(tiles: str = CUDA_TILES) -> TopKTopP:
    """vLLM's ``apply_top_k_top_p_triton``, run by Triton's interpreter, with the tiles vLLM picks for ``tiles``
    tensors. Raises RuntimeError where ``why_no_copy()`` gives a reason."""
    kernel: TopKTopP = copy_namespace(tiles)["apply_top_k_top_p_triton"]

    def apply_top_k_top_p_triton(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        with interpreting():
            return kernel(logits, k, p)

    _tiles_of_copy[apply_top_k_top_p_triton] = tiles
    return apply_top_k_top_p_triton


# the interpreted ``apply_top_k_top_p_triton`` functions made here -> their tiles
_tiles_of_copy: dict[Callable[..., Any], str] = {}

# what ``monolithic_top_k_top_p`` reads from vLLM 0.31's module (vLLM's own launch of its monolithic kernel)
MONOLITHIC_NAMES = (
    "_topk_topp",
    "_TRITON_BUFFER_CACHE",
    "_TRITON_TABLE_CACHE",
    "_NORMAL_CDF_TO_SIGMA_TABLE",
    "_PERCENTILE_TO_STD_TABLE",
    "next_power_of_2",
    "num_compute_units",
    "gpu_sync_allowed",
)
MONOLITHIC_PARAMETERS = (
    "logits",
    "buffer",
    "percentile_to_std_table",
    "normal_cdf_to_sigma_table",
    "k",
    "p",
    "mask_value",
    "num_sm",
)


def split_max_batch(scope: dict[str, Any]) -> int | None:
    """The largest call (rows) that a kernel module's ``apply_top_k_top_p_triton`` sends through its split-row top-p
    pipeline on CUDA (vLLM 0.31: 64), or None where the module has no such pipeline (0.25.1)."""
    limit = scope.get("_SPLIT_MAX_BATCH")
    return limit if isinstance(limit, int) else None


def monolithic_problem(scope: dict[str, Any]) -> str | None:
    """Why ``monolithic_top_k_top_p`` cannot launch this kernel module's monolithic kernel, or None."""
    missing = [name for name in MONOLITHIC_NAMES if name not in scope]
    if missing:
        return f"{KERNEL_MODULE} has no {', '.join(missing)}"
    try:
        parameters = _parameters(scope["_topk_topp"])
    except (TypeError, ValueError) as error:
        return f"{KERNEL_MODULE}._topk_topp's signature cannot be read ({error})"
    if parameters != MONOLITHIC_PARAMETERS:
        return f"{KERNEL_MODULE}._topk_topp takes {parameters}, not {MONOLITHIC_PARAMETERS}"
    return None


def monolithic_top_k_top_p(
    scope: dict[str, Any], logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """vLLM 0.31's monolithic top-k/top-p kernel on every row, whatever the call's size: what its
    ``apply_top_k_top_p_triton`` launches for a call of more than ``_SPLIT_MAX_BATCH`` rows (its ``_topk_topp``, with
    the module's own cached scratch buffer and tables), without the split-row pipeline it takes for smaller ones. A
    row's result is its own (one program per row), so any rows may be passed. ``scope``: the module's globals (vLLM's
    on CUDA, the interpreted copy's here)."""
    rows = cut_rows(logits, k, p)
    if rows is None:
        return logits
    compute_units: int = scope["num_compute_units"](rows.device.index)
    programs = min(compute_units, rows.size(0))
    buffers = scope["_TRITON_BUFFER_CACHE"]
    key = (rows.device, rows.dtype, rows.size(1))
    buffer = buffers.get(key)
    if buffer is None or buffer.shape[0] < programs:
        buffer = rows.new_empty((min(scope["next_power_of_2"](programs), compute_units), rows.size(1)))
        buffers[key] = buffer
    launch_topk_topp(scope, rows, buffer[:programs], k, p, compute_units)
    return rows


def cut_rows(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor | None:
    """``logits`` as vLLM's top-k/top-p kernels read them (float32 [rows, vocabulary], each row contiguous), or None
    where there is nothing to cut (no rows, neither k nor p): then the caller returns ``logits`` as they are."""
    assert logits.ndim == 2 and logits.dtype == torch.float32
    if logits.size(0) == 0 or (k is None and p is None):
        return None
    return logits if logits.stride(1) == 1 else logits.contiguous()


def launch_topk_topp(
    scope: dict[str, Any],
    logits: torch.Tensor,
    buffer: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    num_sm: int,
) -> None:
    """vLLM 0.31's ``_topk_topp`` on ``logits`` in place, as vLLM calls it: ``buffer`` its scratch rows (one per
    program), ``num_sm`` the programs it may launch (it launches ``min(num_sm, rows)``), the lookup tables from its
    module's cache."""
    normal_cdf_to_sigma, percentile_to_std = kernel_tables(scope, logits)
    scope["_topk_topp"](
        logits,
        buffer,
        percentile_to_std,
        normal_cdf_to_sigma,
        None if k is None else k.to(torch.int32),
        None if p is None else p.to(torch.float32),
        float("-inf"),
        num_sm,
    )


@functools.cache
def _parameters(function: Any) -> tuple[str, ...]:
    """A function's parameter names (read once per function: ``wide_launch.launchable`` asks on every chunk)."""
    return tuple(inspect.signature(function).parameters)


def kernel_tables(scope: dict[str, Any], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(normal CDF to sigma, percentile to std): vLLM's lookup tables on the logits' device, from (and into) its
    kernel module's cache, made as its launch makes them (vLLM 0.31 under its sync-debug switch)."""
    cache = scope["_TRITON_TABLE_CACHE"]
    tables = cache.get(logits.device)
    if tables is None:
        with scope.get("gpu_sync_allowed", contextlib.nullcontext)():
            tables = (
                logits.new_tensor(scope["_NORMAL_CDF_TO_SIGMA_TABLE"]),
                logits.new_tensor(scope["_PERCENTILE_TO_STD_TABLE"]),
            )
        cache[logits.device] = tables
    return tables  # type: ignore[no-any-return]


@functools.cache
def interpreted_monolithic(tiles: str = CUDA_TILES) -> TopKTopP | None:
    """``monolithic_top_k_top_p`` on the interpreted copy (``tiles``), or None where the copy's kernel has no
    split-row pipeline (vLLM 0.25.1: its ``apply_top_k_top_p_triton`` is already that at every size)."""
    scope = copy_namespace(tiles)
    if split_max_batch(scope) is None or monolithic_problem(scope) is not None:
        return None

    def monolithic(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        with interpreting():
            return monolithic_top_k_top_p(scope, logits, k, p)

    return monolithic


def copy_scope(kernel: Callable[..., Any]) -> tuple[dict[str, Any], TopKTopP | None] | None:
    """(module globals, interpreted monolithic function) behind an interpreted ``apply_top_k_top_p_triton`` made
    here, or None where ``kernel`` is not one."""
    tiles = _tiles_of_copy.get(kernel)
    if tiles is None:
        return None
    return copy_namespace(tiles), interpreted_monolithic(tiles)


@functools.cache
def copy_namespace(tiles: str) -> dict[str, Any]:
    """The executed copy of vLLM's kernel module (its functions, decorated in interpreter mode)."""
    if reason := why_no_copy():
        raise RuntimeError(f"vLLM's Triton top-k/top-p kernel cannot run in the interpreter: {reason}")
    found = _kernel_source()
    assert not isinstance(found, str)  # why_no_copy checked it
    source = found[1]
    digest = _digest(source)
    for old, new, occurrences in PROVEN[digest][1]:
        if source.count(old) != occurrences:
            raise RuntimeError(f"{KERNEL_MODULE}: {old!r} occurs {source.count(old)} times, not {occurrences}")
        source = source.replace(old, new)
    tiles_of = {"TILES_OF": lambda device_type: tiles}
    namespace = executed_in_interpreter(source, f"trl_vlm_fixes_interpreted_{tiles}", tiles_of)  # checked above
    namespace["num_compute_units"] = lambda device_id=None: _PROGRAMS
    return namespace


def executed_in_interpreter(source: str, name: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The globals of ``source`` executed as module ``name`` (with ``extra`` globals), its ``@triton.jit`` functions
    decorated in interpreter mode. The interpreter re-reads each kernel's source with ``inspect``, so the source is
    written to a file first: one per user, name and content (written atomically: another process reading it sees
    one whole file)."""
    directory = Path(tempfile.gettempdir()) / f"trl_vlm_fixes_kernels_{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{name}_{_digest(source)[:12]}.py"
    if not path.exists() or path.read_text() != source:
        staged = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        staged.write_text(source)
        staged.replace(path)
    namespace: dict[str, Any] = {"__name__": name, "__file__": str(path), **(extra or {})}
    with interpreting():
        exec(compile(source, str(path), "exec"), namespace)
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
