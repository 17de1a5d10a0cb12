"""weight_buckets: the colocated weight push in buckets of parameters, one engine call and one gather per bucket.

TRL 1.9.1's ``VLLMGeneration.sync_weights`` (colocate mode, no PEFT, no FSDP) pushes the trainer's weights one
parameter at a time: for each of ``model.named_parameters()`` one ``self._dist.gather_params([param])`` (a DeepSpeed
ZeRO-3 gather of that one parameter; a no-op otherwise) and one
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, param.data)])``: hundreds of
calls per push, each walking vLLM's ``AutoWeightsLoader`` over the whole model for a single tensor (upstream: one call
per tensor since the colocate mode was added; TRL >= 1.16 streams the same per-parameter calls through
``_iter_named_params``).

Where TRL's ``sync_weights`` is exactly TRL 1.9.1's (checked on its AST, ``TRL_1_9_1_SYNC_WEIGHTS``), this fix replays
it with the per-parameter loop replaced: the parameters, in ``named_parameters()`` order and under TRL's own names
(``_fix_param_name_to_vllm``), are cut into consecutive buckets of at most ``TRL_VLM_FIXES_WEIGHT_BUCKET_MB`` MiB (a
parameter larger than that is a bucket of its own); each bucket is one ``gather_params(bucket)`` and one
``load_weights([(name, param.data), ...])`` read inside that gather. Everything else runs as TRL runs it: with sleep
mode TRL's ``empty_cache()`` and ``llm.wake_up(tags=["weights"])`` before, ``llm.reset_prefix_cache()`` after. The
buckets are cut from the parameters' sizes alone (``ds_numel`` under ZeRO-3), the same on every rank, so every rank
makes the same gathers in the same order, as upstream.

It steps aside, with one log line saying why, and TRL's own code runs: in server mode, with a PEFT model (TRL gathers
the whole model once and merges the adapters), under FSDP (TRL's own traversal), and where TRL's ``sync_weights`` or
the colocated branch of its ``_push_param_to_vllm`` is not TRL 1.9.1's (TRL >= 1.16 among them).
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..declaration import Applicability, Fix, Target
from ..log_once import warn_once
from ..logs import fix_logger
from ..registry import value
from ..source_shape import calls_method, function_tree
from ..switches import Setting, SwitchValueError

LOGGER = fix_logger(__name__)
_MODULE = "trl.generation.vllm_generation"
MIB = 1 << 20

# Under DeepSpeed ZeRO-3 a bucket's parameters are gathered (full size, on the GPU) while it is pushed; otherwise a
# bucket holds references to the live parameters and costs nothing. 512 MiB stays below the largest single tensor
# TRL already gathers alone in a Qwen3.5 of 2B and up (the embedding, 248,320 x hidden in bf16: 0.95 GiB at hidden
# 2048); see docs/fixes/weight_buckets.md#settings.
DEFAULT_BUCKET_MB = 512.0
BUCKET_VARIABLE = "TRL_VLM_FIXES_WEIGHT_BUCKET_MB"
ACCEPTED = f"a bucket size in MiB, a number above 0 (default {DEFAULT_BUCKET_MB:g})"


def parse_bucket_mb(raw: str) -> float:
    """``TRL_VLM_FIXES_WEIGHT_BUCKET_MB``: a positive, finite number of MiB (fractions allowed)."""
    try:
        megabytes = float(raw.strip())
    except ValueError:
        megabytes = math.nan
    if math.isfinite(megabytes) and megabytes > 0:
        return megabytes
    raise SwitchValueError(
        f"{BUCKET_VARIABLE}={raw!r} is not a bucket size. Accepted values: {ACCEPTED}. "
        "TRL_VLM_FIXES_WEIGHT_BUCKETS=0 turns the buckets off (one push per parameter, as upstream)."
    )


BUCKET_MB = Setting("bucket_mb", BUCKET_VARIABLE, parse_bucket_mb, DEFAULT_BUCKET_MB, ACCEPTED, "MiB")

# TRL 1.9.1's sync_weights, the body this fix replays (docstring and comments left out: compared as ASTs, so quotes,
# spacing, line breaks and comments change nothing). Any other body: the fix steps aside and TRL's own code runs.
TRL_1_9_1_SYNC_WEIGHTS = """
def sync_weights(self):
    if self.mode == "colocate" and self.enable_sleep_mode:
        empty_cache()
        self.llm.wake_up(tags=["weights"])
    model = self.model
    accelerator = self.accelerator
    if is_peft_model(model):
        with self._dist.gather_params(list(model.parameters())):
            model.merge_adapter()
            if self._dist.is_fsdp:
                self._sync_fsdp_params_to_vllm(model)
            else:
                for name, param in model.named_parameters():
                    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                    if model.prefix in name:
                        continue
                    if "original_module" in name:
                        continue
                    name = self._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."])
                    self._push_param_to_vllm(name, param.data)
            model.unmerge_adapter()
    else:
        if self._dist.is_fsdp:
            self._sync_fsdp_params_to_vllm(model)
        else:
            for name, param in model.named_parameters():
                name = self._fix_param_name_to_vllm(name)
                with self._dist.gather_params([param]):
                    self._push_param_to_vllm(name, param.data)
    if self.mode == "server" and accelerator.is_main_process:
        self.vllm_client.reset_prefix_cache()
    elif self.mode == "colocate":
        self.llm.reset_prefix_cache()
"""
# ... and its _push_param_to_vllm, whose colocated branch the buckets replace with one call per bucket
TRL_1_9_1_PUSH_PARAM = """
def _push_param_to_vllm(self, name: str, param) -> None:
    if self.mode == "server" and self.accelerator.is_main_process:
        self.vllm_client.update_named_param(name, param)
    elif self.mode == "colocate":
        self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, param)])
"""


def _without_docstring(tree: ast.AST) -> str | None:
    """The first function of ``tree``, its docstring dropped, as ``ast.dump`` text (no line numbers), or None."""
    function = next((node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)), None)
    if function is None:
        return None
    body = list(function.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    bare = copy.copy(function)
    bare.body = body
    return ast.dump(bare)


_EXPECTED = {
    "sync_weights": _without_docstring(ast.parse(TRL_1_9_1_SYNC_WEIGHTS)),
    "_push_param_to_vllm": _without_docstring(ast.parse(TRL_1_9_1_PUSH_PARAM)),
}


def _plain(function: Callable[..., Any]) -> Callable[..., Any]:
    """The function itself: a bound method's function, a wrapper's innermost function."""
    plain: Callable[..., Any] = inspect.unwrap(getattr(function, "__func__", function))
    return plain


def shape_problem(sync_weights: Callable[..., Any], push_param: Callable[..., Any] | None = None) -> str | None:
    """Why TRL's ``sync_weights`` (and ``_push_param_to_vllm``) are not the TRL 1.9.1 bodies this fix replays, or
    None where they are (decided once per pair of functions)."""
    return _shape_problem(_plain(sync_weights), None if push_param is None else _plain(push_param))


@functools.lru_cache(maxsize=16)
def _shape_problem(sync_weights: Callable[..., Any], push_param: Callable[..., Any] | None) -> str | None:
    tree = function_tree(sync_weights)
    if tree is None:
        return "the source of TRL's sync_weights cannot be read: the fix cannot confirm the push it replays"
    if calls_method(tree, "_iter_named_params"):
        return (
            "this TRL's sync_weights streams its parameters through _iter_named_params (TRL >= 1.16), not the "
            "per-parameter loop of TRL 1.9.1 this fix replays"
        )
    if _without_docstring(tree) != _EXPECTED["sync_weights"]:
        return "this TRL's sync_weights is not TRL 1.9.1's, the body this fix replays"
    if push_param is not None:
        push_tree = function_tree(push_param)
        if push_tree is None or _without_docstring(push_tree) != _EXPECTED["_push_param_to_vllm"]:
            return "this TRL's _push_param_to_vllm is not TRL 1.9.1's (one load_weights([(name, param)]) per call)"
    return None


def installed_shape_problem() -> str | None:
    """Why the TRL imported in this process does not have the push this fix replays, or None (also where TRL's
    module is not imported yet: nothing to read). The shape is checked when TRL calls ``sync_weights`` (the fix then
    steps aside, ``scope`` says why); this is the same question asked before any trainer exists."""
    import sys

    generation_class = getattr(sys.modules.get(_MODULE), "VLLMGeneration", None)
    if generation_class is None:
        return None
    return shape_problem(generation_class.sync_weights, getattr(generation_class, "_push_param_to_vllm", None))


def _generation_functions(generation: Any, sync_weights: Callable[..., Any] | None) -> tuple[Any, Any]:
    cls = type(generation)
    return sync_weights if sync_weights is not None else cls.sync_weights, getattr(cls, "_push_param_to_vllm", None)


def _trl_globals(sync_weights: Callable[..., Any]) -> Mapping[str, Any]:
    """The module namespace TRL's own sync_weights resolves its names in (``empty_cache``, ``is_peft_model``)."""
    names: Mapping[str, Any] = getattr(_plain(sync_weights), "__globals__", {})
    return names


def aside_reason(generation: Any, sync_weights: Callable[..., Any] | None = None) -> str | None:
    """Why the buckets step aside for this ``VLLMGeneration`` (TRL's own push runs), or None where they act."""
    mode = getattr(generation, "mode", None)
    if mode != "colocate":
        return f"{mode} mode: TRL pushes through its server client, one request per parameter, left as it is"
    function, push_param = _generation_functions(generation, sync_weights)
    if problem := shape_problem(function, push_param):
        return problem
    if push_param is None:
        return "this TRL's VLLMGeneration has no _push_param_to_vllm: not the push of TRL 1.9.1 this fix replays"
    is_peft_model = _trl_globals(function).get("is_peft_model")
    if is_peft_model is None:
        return "TRL's sync_weights resolves no is_peft_model: not the push of TRL 1.9.1 this fix replays"
    if is_peft_model(generation.model):
        return "a PEFT model: TRL gathers the whole model once, merges the adapters and pushes inside that gather"
    dist = getattr(generation, "_dist", None)
    if dist is None or not hasattr(dist, "is_fsdp"):
        return "this VLLMGeneration has no _dist.is_fsdp: not the push of TRL 1.9.1 this fix replays"
    if dist.is_fsdp:
        return "FSDP: TRL's own module-by-module traversal pushes the weights"
    return None


def bucket_bytes() -> int:
    """The bucket size as the last ``apply()`` read it, in bytes."""
    return max(1, int(float(value("weight_buckets", BUCKET_MB.key)) * MIB))


def parameter_bytes(parameter: Any) -> int:
    """The bytes a parameter holds once gathered: DeepSpeed ZeRO-3 keeps an empty ``data`` and the full size in
    ``ds_numel``."""
    numel = getattr(parameter, "ds_numel", None)
    return int(numel if numel is not None else parameter.numel()) * int(parameter.element_size())


def buckets(named: Iterator[tuple[str, Any]], limit: int) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive runs of ``named`` of at most ``limit`` bytes each (a parameter above ``limit`` alone), in order."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, parameter in named:
        nbytes = parameter_bytes(parameter)
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, parameter))
        size += nbytes
    if bucket:
        yield bucket


def push_in_buckets(generation: Any, sync_weights: Callable[..., Any], limit: int) -> None:
    """TRL 1.9.1's ``sync_weights`` for a colocated engine, without PEFT or FSDP, its parameters pushed a bucket at a
    time (see the module's docstring)."""
    names = _trl_globals(sync_weights)
    if generation.mode == "colocate" and generation.enable_sleep_mode:
        names["empty_cache"]()
        generation.llm.wake_up(tags=["weights"])
    model = generation.model
    calls = parameters = 0
    named = ((generation._fix_param_name_to_vllm(name), parameter) for name, parameter in model.named_parameters())
    for bucket in buckets(named, limit):
        with generation._dist.gather_params([parameter for _, parameter in bucket]):
            loader = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
            loader.load_weights([(name, parameter.data) for name, parameter in bucket])
        calls += 1
        parameters += len(bucket)
    generation.llm.reset_prefix_cache()
    warn_once(
        ("weight_buckets", "acts"),
        "pushes the colocated engine's weights in buckets of up to %g MiB: %d load_weights calls for %d parameters "
        "(TRL: one per parameter)",
        limit / MIB,
        calls,
        parameters,
        logger=LOGGER,
        level=logging.INFO,
    )


RANKS_WAIT_SECONDS = 120.0  # how long a rank waits for the others to say their bucket size, at the first push
_ranks_verdict: list[str | None] = []  # this process's one verdict: None (the ranks agree) or why they do not


def ranks_disagree(generation: Any, limit: int) -> str | None:
    """Under DeepSpeed ZeRO-3 every rank must make the same gathers (collectives) in the same order: a rank with
    another bucket size, or without the fix, would leave the others waiting in a gather. So at the first push each
    rank puts its bucket size in torch's rendezvous key-value store and reads every rank's (a key-value exchange, not a
    collective: a rank that never writes costs at most ``RANKS_WAIT_SECONDS``). None where they all said the same, or
    where there is nothing to agree on (no ZeRO-3, one process); else the reason, and every rank then pushes as TRL
    does. Decided once per process."""
    if not getattr(getattr(generation, "_dist", None), "is_zero3", False):
        return None
    if _ranks_verdict:
        return _ranks_verdict[0]
    verdict = _compare_with_ranks(limit)
    _ranks_verdict.append(verdict)
    return verdict


def _compare_with_ranks(limit: int) -> str | None:
    from datetime import timedelta

    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() <= 1:
            return None
        store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        keys = [f"trl_vlm_fixes/weight_buckets/rank{peer}" for peer in range(world)]
        store.set(keys[rank], str(limit))
        store.wait(keys, timedelta(seconds=RANKS_WAIT_SECONDS))
        said = {peer: store.get(key).decode() for peer, key in enumerate(keys)}
    except Exception as error:  # noqa: BLE001 - a rank that never said (the fix off there, no plugin): TRL's push
        return f"not every rank said its bucket size within {RANKS_WAIT_SECONDS:g} s under ZeRO-3 ({error!r})"
    if len(set(said.values())) > 1:
        sizes = ", ".join(f"rank {peer}: {int(size) / MIB:g} MiB" for peer, size in said.items())
        return f"the ranks' bucket sizes differ under ZeRO-3 ({sizes}; set {BUCKET_VARIABLE} alike on every rank)"
    return None


def sync_weights_wrapper(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    reason = "sync_weights called with arguments" if args or kwargs else aside_reason(instance, wrapped)
    if reason is None and (disagreement := ranks_disagree(instance, bucket_bytes())):
        warn_once(("weight_buckets", "ranks"), "steps aside: %s; TRL's own push runs", disagreement, logger=LOGGER)
        return wrapped(*args, **kwargs)
    if reason is not None:
        warn_once(
            ("weight_buckets", reason),
            "steps aside: %s; TRL's own push runs",
            reason,
            logger=LOGGER,
            level=logging.INFO,
        )
        return wrapped(*args, **kwargs)
    return push_in_buckets(instance, wrapped, bucket_bytes())


def scope(trainer: Any) -> str | None:
    """The buckets replace TRL 1.9.1's colocated per-parameter push (no PEFT, no FSDP)."""
    generation = getattr(trainer, "vllm_generation", None)
    if not getattr(trainer, "use_vllm", False) or generation is None:
        return "use_vllm is off: no weight push"
    return aside_reason(generation)


# ``scope`` before the trainer exists: TRL's colocated push, where it is TRL 1.9.1's loop (PEFT and FSDP are not part
# of a plan: the trainer-start line says)
APPLICABILITY = Applicability(
    modes=("colocate",),
    aside={"none": "no weight push", "server": "TRL pushes through its server client, left as it is"},
    installed=installed_shape_problem,
)
applies = APPLICABILITY.reason


FIX = Fix(
    name="weight_buckets",
    summary="colocated weight push in buckets: one gather and one load_weights per bucket, not per parameter",
    packages=("trl", "vllm"),
    targets=(Target(_MODULE, "VLLMGeneration.sync_weights", sync_weights_wrapper),),
    settings=(BUCKET_MB,),
    selftest="trl_vlm_fixes.selftest.checks.weight_buckets:check",
    scope=scope,
    applicability=APPLICABILITY,
)
