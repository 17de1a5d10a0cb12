"""The engine side of sampling_parity: every sampling step takes one knowable top-k/top-p rule.

vLLM 0.25.1's ``apply_top_k_top_p`` (``vllm/v1/sample/ops/topk_topp_sampler.py``, what ``forward_native`` calls on
CUDA for TRL's ``logprobs_mode="processed_logprobs"``) picks its rule by the number of requests in the step:
``HAS_TRITON and logits.shape[0] >= 8`` -> ``apply_top_k_top_p_triton`` (exactly k tokens at a top-k tie, an
approximate top-p cut), else ``apply_top_k_top_p_pytorch`` (every tied token kept, the cut by sorted position). A
GRPO rollout starts with 8 or more sequences and ends with fewer as they finish, so a completion's late tokens were
sampled under the other rule, and nobody outside the engine knows which step held how many requests.

The wrapper sends every step through the module's own ``apply_top_k_top_p_triton`` where the module has Triton (read
from the wrapped function's module globals at call time, where ``forward_native`` reads them, so the engine stand-in
can set them); elsewhere it calls vLLM's function unchanged, and says so once. For 8 or more requests that is the
call vLLM makes itself; the cost for fewer is ``benchmarks/gpu/sampler_path.py``'s. vLLM 0.31 sends every size to
the kernel itself, but its kernel then sends a small call of top-p without top-k (at most ``_SPLIT_MAX_BATCH`` = 64
rows, on CUDA) through a split-row pipeline and a larger one through its monolithic kernel: there the wrapper sends
such steps to the monolithic kernel (``monolithic.apply_kernel``, what the trainer applies), and only a vLLM whose
kernel has no such split needs no wrapper. The wrapper reads no tensor's values (it looks at which of k and p are
given).

Only the engines whose trainer computes TRL's ratio or off-policy mask are routed: the colocated engine while a
GRPO rollout the fix serves generates (``routed``: sampling runs in the caller's thread there, vLLM's in-process
executor), and TRL's server engine (``trl vllm-serve``: its only clients are TRL's trainers; marked when TRL's server
is started, ``ROUTE_ENV``, which the engine's worker processes inherit). Every other engine in the process samples as
vLLM built it.

vLLM's V2 model runner (0.25.1's default for models neither hybrid nor MoE: Qwen3-VL, Qwen2.5-VL) binds
``apply_top_k_top_p`` by name in its sampler and sampling-state modules when they are imported: those names are
wrapped too, whatever the import order (a post-import hook fires at once for a module already imported).
"""

from __future__ import annotations

import ast
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ...call_arguments import bind
from ...declaration import Target
from ...log_once import warn_once
from ...logs import fix_logger
from ...source_shape import calls_name, function_tree

LOGGER = fix_logger(__name__)
MODULE = "vllm.v1.sample.ops.topk_topp_sampler"
KERNEL_MODULE = "vllm.v1.sample.ops.topk_topp_triton"
KERNEL = "apply_top_k_top_p_triton"
SORT = "apply_top_k_top_p_pytorch"
# the V2 model runner's modules that bind ``apply_top_k_top_p`` by name at their import
V2_MODULES = ("vllm.v1.worker.gpu.sample.sampler", "vllm.v1.worker.gpu.sample.states")
# set in a process whose engine TRL's server built; inherited by the engine's worker processes
ROUTE_ENV = "TRL_VLM_FIXES_ROUTE_ENGINE_SAMPLER"

_routed: ContextVar[bool] = ContextVar("trl_vlm_fixes_engine_sampler_routed", default=False)


@contextmanager
def routed() -> Iterator[None]:
    """The engine steps run inside this block (a trainer's rollout that computes TRL's ratio) take the kernel."""
    token = _routed.set(True)
    try:
        yield
    finally:
        _routed.reset(token)


def routes_here() -> bool:
    """Is the step in progress one of an engine whose trainer computes TRL's ratio or mask, with the fix on? (A V2
    module imported after the plugin bound the wrapper itself: a revert leaves it there, and it must then pass.)"""
    from ...registry import active

    return (_routed.get() or os.environ.get(ROUTE_ENV) == "1") and active().is_enabled("sampling_parity")


def started_as_trl_server(argv: list[str]) -> bool:
    """Was this process started as TRL's server (``trl vllm-serve``, ``python -m trl.scripts.vllm_serve``, or its
    file), read from the interpreter's own command line (``sys.orig_argv``: ``-m`` is still there)?"""
    for index, word in enumerate(argv):
        following = argv[index + 1] if index + 1 < len(argv) else ""
        if word == "-m" and following == "trl.scripts.vllm_serve":
            return True
        if os.path.basename(word) == "trl" and following == "vllm-serve":
            return True
        if word.replace(os.sep, "/").endswith("trl/scripts/vllm_serve.py"):
            return True
    return False


def mark_if_trl_server() -> None:
    """In TRL's server process, at the plugin's import (before any engine worker is started): the process and the
    engine's workers, which inherit the mark, route every step (its only clients are TRL's trainers)."""
    if started_as_trl_server(list(getattr(sys, "orig_argv", sys.argv))):
        os.environ[ROUTE_ENV] = "1"


def _why_not_routed(scope: dict[str, Any]) -> str | None:
    """Why this engine's steps stay on vLLM's own dispatch (it has no Triton kernel to send them to), or None. (On
    vLLM's CPU platform with Triton, vLLM itself sends every step to the kernel: routing there changes nothing.)"""
    if not scope.get("HAS_TRITON") or KERNEL not in scope:
        return "vLLM has no Triton here: every step takes its sort-based top-k/top-p (apply_top_k_top_p_pytorch)"
    return None


def send_every_step_through_triton(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``apply_top_k_top_p(logits, k, p)``: the Triton kernel whatever the step's size, where vLLM has it (vLLM 0.31:
    top-p alone to its monolithic kernel, ``monolithic.apply_kernel``)."""
    if not routes_here():  # an engine whose trainer computes no ratio (or none at all): as vLLM built it
        return wrapped(*args, **kwargs)
    arguments = bind(wrapped, args, kwargs).arguments
    if arguments.get("k") is None and arguments.get("p") is None:
        return wrapped(*args, **kwargs)
    scope: dict[str, Any] = getattr(wrapped, "__globals__", {})
    if reason := _why_not_routed(scope):
        warn_once(
            ("engine_sampler", reason), "engine sampler left as vLLM's: %s", reason, logger=LOGGER, level=logging.INFO
        )
        return wrapped(*args, **kwargs)
    from .monolithic import apply_kernel

    return apply_kernel(scope[KERNEL], arguments["logits"], arguments.get("k"), arguments.get("p"))


def routes_top_p_alone() -> str | None:
    """Why this process's routed engine steps of top-p alone do not take the kernel's monolithic rule at every size
    (vLLM 0.31), or None where they do: the plugin's wrapper is on vLLM's ``apply_top_k_top_p`` and the kernel module's
    monolithic kernel can be launched (``kernel_copy.monolithic_problem``)."""
    from . import kernel_copy

    current = getattr(importlib.import_module(MODULE), "apply_top_k_top_p", None)
    if getattr(current, "_self_wrapper", None) is not send_every_step_through_triton:
        return "the plugin's engine wrapper is not on vLLM's apply_top_k_top_p"
    problem = kernel_copy.monolithic_problem(vars(importlib.import_module(KERNEL_MODULE)))
    return f"the engine wrapper cannot send such steps to the monolithic kernel: {problem}" if problem else None


def _compares_batch_size(tree: ast.AST) -> bool:
    """Does the dispatch compare ``<tensor>.shape[0]`` (a step's number of requests) with anything?"""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            if any(
                isinstance(s, ast.Subscript) and isinstance(s.value, ast.Attribute) and s.value.attr == "shape"
                for s in sides
            ):
                return True
    return False


def dispatch_problem(function: Callable[..., Any]) -> str | None:
    """Why ``apply_top_k_top_p`` is no longer a choice between vLLM's kernel and its sort path, or None."""
    tree = function_tree(function)
    if tree is None:
        return "its source cannot be read"
    missing = [name for name in (KERNEL, SORT) if not calls_name(tree, name)]
    if missing:
        return f"it no longer calls {', '.join(missing)}"
    return None


def compares_step_size(function: Callable[..., Any]) -> bool:
    """Does the dispatch pick its path by the step's number of requests (0.25.1's ``logits.shape[0] >= 8``)?"""
    tree = function_tree(function)
    return tree is not None and _compares_batch_size(tree)


def _kernel_scope_of(function: Callable[..., Any]) -> dict[str, Any]:
    """The globals of the kernel module ``function`` dispatches to: its ``apply_top_k_top_p_triton``'s, or, for vLLM's
    own module imported without Triton (the name is then absent), vLLM's kernel module; else empty."""
    scope: dict[str, Any] = getattr(function, "__globals__", {})
    kernel = scope.get(KERNEL)
    if kernel is not None:
        return dict(getattr(kernel, "__globals__", {}))
    if str(scope.get("__name__", "")).startswith("vllm."):
        try:
            return vars(importlib.import_module(KERNEL_MODULE))
        except ImportError:
            return {}
    return {}


def splits_small_calls(function: Callable[..., Any]) -> bool:
    """Does the kernel ``function`` dispatches to pick its top-p rule by the call's size (vLLM 0.31's split-row
    pipeline, ``_SPLIT_MAX_BATCH``)?"""
    from . import kernel_copy

    return kernel_copy.split_max_batch(_kernel_scope_of(function)) is not None


def every_step_on_kernel(function: Callable[..., Any]) -> str | None:
    """vLLM already sends every step through the kernel where it has Triton (no batch-size test) and its kernel takes
    one rule whatever the call's size, or None. (vLLM 0.31 has no batch-size test, but its kernel splits small calls of
    top-p alone: the wrapper is needed there.)"""
    tree = function_tree(function)
    if tree is None or dispatch_problem(function) or _compares_batch_size(tree) or splits_small_calls(function):
        return None
    return f"vLLM's apply_top_k_top_p sends every step through {KERNEL} whatever its size"


def _unwrapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's own function behind a name the V2 runner bound after the plugin wrapped it."""
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    return function


def _v2_dispatch_problem(function: Callable[..., Any]) -> str | None:
    return dispatch_problem(_unwrapped(function))


def _v2_every_step_on_kernel(function: Callable[..., Any]) -> str | None:
    return every_step_on_kernel(_unwrapped(function))


ENGINE_SAMPLER_TARGETS = (
    Target(
        MODULE,
        "apply_top_k_top_p",
        send_every_step_through_triton,
        required_parameters=("logits", "k", "p"),
        shape_problem=dispatch_problem,
        upstream_fixed=every_step_on_kernel,
    ),
    *(
        Target(
            module,
            "apply_top_k_top_p",
            send_every_step_through_triton,
            required_parameters=("logits", "k", "p"),
            shape_problem=_v2_dispatch_problem,
            upstream_fixed=_v2_every_step_on_kernel,
            optional=True,
        )
        for module in V2_MODULES
    ),
)

mark_if_trl_server()
